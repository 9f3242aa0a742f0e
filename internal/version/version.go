// Package version holds the build's version, set with
// -ldflags "-X github.com/better-compute/better-compute/internal/version.Version=…".
package version

// Version of better-compute and bcd.
var Version = "0.1.0"

// Protocol versions of the agent protocol this build speaks.
const (
	ProtocolMin = 1
	ProtocolMax = 1
)
