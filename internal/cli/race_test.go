//go:build race

package cli_test

// raceEnabled: this test binary runs under the race detector, which makes
// dev (run in-process here) several times slower to start and stop.
const raceEnabled = true

// raceSlowdown is how many times longer dev gets under the detector.
const raceSlowdown = 5
