// Package backup makes and restores the control plane's backup archive
// (R16.3): one tar.gz holding a manifest, a consistent copy of the SQLite
// database taken while the server runs, and the machine PKI's public and
// encrypted files. BETTER_COMPUTE_SECRET, which decrypts the keys, is never
// written here: it is kept apart from the archive, so a leaked archive
// holds no usable key. It is read only to derive the key of the manifest's
// MAC (mac.go, R23.2), so that a restore takes only an archive made by
// someone holding the secret.
//
// A restore writes a fresh data directory, all or nothing (staged beside
// the target, renamed into place), refuses an archive whose MAC does not
// verify (one without a MAC, of an older release, only when told to), a
// schema newer than this binary, an archive whose members do not match the
// manifest or do not fit in the free space, and revokes every join token
// that was live when the backup was taken: the copy does not know the uses
// spent after it, and none may be spent twice.
//
// PostgreSQL is backed up by its own tools (pg_dump, point-in-time
// recovery): Create refuses it (docs/operations/backup-restore.md).
//
// Importers: the CLI (better-compute backup and restore) and tests.
package backup
