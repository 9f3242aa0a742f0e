// Package version holds the build's version. A release build sets it with
//
//	go build -ldflags "-X github.com/better-compute/better-compute/internal/shared/version.Version=…"
//
// (-X takes the package's full import path; a path that names no package
// is ignored without an error, so check the result with `bcd version`).
// No script in the repository sets it: every build, scripts/images
// included, reports the default below.
package version

// Version of better-compute and bcd.
var Version = "0.1.0"

// Protocol versions of the agent protocol this build speaks. Version 2
// binds the whole join request in the seal, opens each session with a
// nonce the node key signs, and signs heartbeats and command results:
// version 1 daemons cannot talk to a version 2 control plane.
const (
	ProtocolMin = 2
	ProtocolMax = 2
)
