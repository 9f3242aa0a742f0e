-- +goose Up
-- The machine PKI's keys once any of them rotates (R16.1,
-- internal/controlplane/rotation). Generation 1 of each kind is the key of
-- the PKI directory, copied here by the first replica of this version to
-- start; later generations exist only here, so every replica and every
-- gateway agrees on them through the database. key_pem is the private key
-- encrypted with BETTER_COMPUTE_SECRET (ca.EncryptKey); key_pem_next holds
-- it under the next secret while that secret rotates. cert is the key's
-- certificate (its SubjectPublicKeyInfo for join-encryption). state is
-- next, current, previous, retired or discarded (rolled back). statement
-- is the previous key's signed word for this one (pki.KeyStatement, the
-- kinds bcd pins), retire_statement the next key's word retiring this one.
CREATE TABLE pki_keys (
    kind             TEXT NOT NULL,
    gen              INTEGER NOT NULL,
    state            TEXT NOT NULL,
    cert             BLOB NOT NULL,
    key_pem          TEXT NOT NULL,
    key_pem_next     TEXT NOT NULL DEFAULT '',
    statement        TEXT NOT NULL DEFAULT '',
    retire_statement TEXT NOT NULL DEFAULT '',
    created_ms       INTEGER NOT NULL,
    changed_ms       INTEGER NOT NULL,
    PRIMARY KEY (kind, gen)
);

-- +goose Down
DROP TABLE pki_keys;
