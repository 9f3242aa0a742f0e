// Package bcd is the root of the node daemon's packages; it holds no code.
// Only bcd's binary (cmd/bcd), the load generator (internal/tools/loadgen)
// and tests import the packages under it, and they import nothing of the
// control plane or the gateway (internal/checks/deptest). The subpackages:
//
//   - bcdcmd: the bcd command line (join, run, renew, status, doctor,
//     fake-machine, version); cmd/bcd is its one-line main;
//   - cmdline: bcd's command tree (flags, help, unknown commands), in
//     place of cobra, which the better-compute CLI keeps;
//   - config: /etc/bcd/config.toml and join-encryption.jwk beside it
//     (R11.1), and the pin sets bcd checks the control plane's keys by;
//   - claims: the hardware claims read from sysfs and procfs (R4.3);
//   - identity: the data directory (node.key, node.crt, bundle.pem,
//     identity.json), the key store seam for the TPM (R4.1, R9.1), the CSR,
//     and replacing or moving an identity aside for `bcd join --reset
//     --yes` (R11.4);
//   - tokeninput: reading the join token from standard input,
//     BCD_JOIN_TOKEN or --token-file (R11.2);
//   - enroll: the network join on top of these (sealing over the request's
//     digest, the Join call over TLS pinned to the serving CA with retries
//     of the same request and join.pending (R4.9), checking the signed
//     answer in order, the well-known fallback and the host build of
//     R11.3);
//   - renew: certificate renewal at about 60% of the lifetime (R13.1);
//   - run: `bcd run`, the session loop to the gateway, signed commands and
//     heartbeats (R12.1, R12.3), with the renewer in the same process;
//   - nodesession: bcd's side of the session protocol (R12.1), which run
//     and the load generator's lean holder share: the Hello that answers
//     the Challenge, the heartbeats (MAC'd or signed), the signature over
//     a command's result and the waits before a reconnect (R19.3); it
//     holds no connection and starts nothing;
//   - site: a site agent's reports of the machines it booted (R10.4);
//   - servertime: the control plane's clock as bcd learned it (R19.3);
//   - diag: the optional /livez, /readyz and /metrics listener;
//   - doctor: `bcd doctor`'s checks of a machine's setup;
//   - tpmdevice, tpmkeys: every TPM 2.0 operation, and the identity key
//     store backed by the TPM (R9).
package bcd
