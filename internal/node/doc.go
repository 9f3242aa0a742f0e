// Package bcd is the root of the node daemon's packages. The daemon's local
// pieces live in its subpackages:
//
//   - config: /etc/bcd/config.toml and join-encryption.jwk beside it (R11.1);
//   - claims: the hardware claims read from sysfs and procfs (R4.3);
//   - identity: the data directory (node.key, node.crt, bundle.pem,
//     identity.json), the key store seam for the TPM (R4.1, R9.1), the CSR,
//     and replacing or moving an identity aside for `bcd join --reset
//     --yes` (R11.4);
//   - tokeninput: reading the join token from standard input,
//     BCD_JOIN_TOKEN or --token-file (R11.2);
//   - join: the network join on top of these (sealing over the request's
//     digest, the Join call over TLS pinned to the serving CA with retries
//     of the same request and join.pending (R4.9), checking the signed
//     response in order, the well-known fallback and the host build of
//     R11.3); join/jointest is its fake JoinService and gateway for tests;
//   - cli: the bcd command line (join, status, version); cmd/bcd is its
//     main.
package bcd
