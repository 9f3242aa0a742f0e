// Package systemd holds the systemd units of the control plane's two
// long-running processes, better-compute.service (serve) and
// better-compute-gateway.service (gateway), and the sysusers.d entry of the
// API's user; docs/operations/install.md ("Running under systemd") says how to
// install them. Its only code is a test: every unit parses, names real
// subcommands and flags of the CLI in ExecStart, keeps its hardening, and
// passes systemd-analyze verify where that is installed.
package systemd
