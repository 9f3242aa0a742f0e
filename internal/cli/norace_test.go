//go:build !race

package cli_test

// raceEnabled: this test binary runs under the race detector.
const raceEnabled = false

// raceSlowdown is how many times longer dev gets under the detector.
const raceSlowdown = 1
