package store

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// PKIKey is one generation of one key of the machine PKI (R16.1). The
// rotation package owns what the fields mean; the store only keeps them.
type PKIKey struct {
	Kind            string
	Gen             int64
	State           string
	Cert            []byte
	KeyPEM          string
	KeyPEMNext      string
	Statement       string
	RetireStatement string
	CreatedAt       time.Time
	ChangedAt       time.Time
}

const pkiKeyColumns = "kind, gen, state, cert, key_pem, key_pem_next, statement, retire_statement, created_ms, changed_ms"

// ListPKIKeys returns every key generation, by kind then generation.
func (t *Tx) ListPKIKeys(ctx context.Context) ([]PKIKey, error) {
	rows, err := t.query(ctx, "SELECT "+pkiKeyColumns+" FROM pki_keys ORDER BY kind, gen")
	if err != nil {
		return nil, fmt.Errorf("list pki keys: %w", err)
	}
	defer rows.Close()
	var out []PKIKey
	for rows.Next() {
		var k PKIKey
		var created, changed int64
		if err := rows.Scan(&k.Kind, &k.Gen, &k.State, &k.Cert, &k.KeyPEM, &k.KeyPEMNext, &k.Statement, &k.RetireStatement, &created, &changed); err != nil {
			return nil, fmt.Errorf("scan pki key: %w", err)
		}
		k.CreatedAt, k.ChangedAt = fromMS(created), fromMS(changed)
		out = append(out, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list pki keys: %w", err)
	}
	return out, nil
}

// PKIKeysVersion returns a value that changes whenever a key row changes
// (the newest change time and the row count), so replicas can poll it
// cheaply and reload the keys only when it moves.
func (t *Tx) PKIKeysVersion(ctx context.Context) (string, error) {
	var n, changed int64
	if err := t.queryRow(ctx, "SELECT COUNT(*), COALESCE(MAX(changed_ms), 0) FROM pki_keys").Scan(&n, &changed); err != nil {
		return "", fmt.Errorf("read pki keys version: %w", err)
	}
	return fmt.Sprintf("%d/%d", n, changed), nil
}

// InsertPKIKey adds a key generation; it reports false, writing nothing,
// when (kind, gen) exists (another replica seeded it first, or a
// concurrent prepare won).
func (t *Tx) InsertPKIKey(ctx context.Context, k PKIKey) (bool, error) {
	res, err := t.exec(ctx, `INSERT INTO pki_keys (`+pkiKeyColumns+`)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, compute_now(), compute_now()) ON CONFLICT (kind, gen) DO NOTHING`,
		k.Kind, k.Gen, k.State, k.Cert, k.KeyPEM, k.KeyPEMNext, k.Statement, k.RetireStatement)
	if err != nil {
		return false, fmt.Errorf("insert pki key %s/%d: %w", k.Kind, k.Gen, err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// UpdatePKIKey writes a key generation's state, key ciphertexts and
// statements. The change time moves to the database clock, but never
// backwards, so PKIKeysVersion always moves with a change.
func (t *Tx) UpdatePKIKey(ctx context.Context, k PKIKey) error {
	res, err := t.exec(ctx, `UPDATE pki_keys SET state = ?, key_pem = ?, key_pem_next = ?, statement = ?, retire_statement = ?,
		changed_ms = CASE WHEN compute_now() > changed_ms THEN compute_now() ELSE changed_ms + 1 END
		WHERE kind = ? AND gen = ?`,
		k.State, k.KeyPEM, k.KeyPEMNext, k.Statement, k.RetireStatement, k.Kind, k.Gen)
	if err != nil {
		return fmt.Errorf("update pki key %s/%d: %w", k.Kind, k.Gen, err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return fmt.Errorf("update pki key %s/%d: no such key", k.Kind, k.Gen)
	}
	return nil
}

// LockPKIKeys serializes rotations: on PostgreSQL it takes a transaction
// lock; SQLite transactions are serialized already.
func (t *Tx) LockPKIKeys(ctx context.Context) error {
	if t.db.dialect != Postgres {
		return nil
	}
	if _, err := t.exec(ctx, "SELECT pg_advisory_xact_lock(7301160017)"); err != nil {
		return fmt.Errorf("lock pki keys: %w", err)
	}
	return nil
}

// LiveCert is a node's newest certificate of its current identity.
type LiveCert struct {
	NodeID    string
	DER       []byte
	CreatedAt time.Time
	// PinsAck are the pins the node's daemon said it holds at its last
	// session (AckNodePins); nil: never said.
	PinsAck []string
}

// LiveNodeCerts returns, for every node that is not retired, its newest
// unrevoked, unexpired certificate of its current identity generation:
// what each node presents now (pki status counts who still presents keys
// of an older generation).
func (t *Tx) LiveNodeCerts(ctx context.Context, now time.Time) ([]LiveCert, error) {
	rows, err := t.query(ctx, `SELECT c.node_id, c.der, c.created_ms, n.pins_ack FROM node_certs c JOIN nodes n ON n.id = c.node_id
		WHERE c.revoked_ms IS NULL AND c.not_after_ms > ? AND n.state <> 'retired' AND c.identity_generation = n.identity_generation
		AND c.created_ms = (SELECT MAX(c2.created_ms) FROM node_certs c2 WHERE c2.node_id = c.node_id AND c2.identity_generation = c.identity_generation)`,
		now.UnixMilli())
	if err != nil {
		return nil, fmt.Errorf("list live node certificates: %w", err)
	}
	defer rows.Close()
	var out []LiveCert
	for rows.Next() {
		var c LiveCert
		var created int64
		var ack string
		if err := rows.Scan(&c.NodeID, &c.DER, &created, &ack); err != nil {
			return nil, fmt.Errorf("scan node certificate: %w", err)
		}
		c.CreatedAt = fromMS(created)
		if ack != "" {
			c.PinsAck = strings.Split(ack, "\n")
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// AckNodePins records the pins node nodeID's daemon said it holds (R21.2),
// when they differ from what is recorded, so a session's Hello writes
// nothing in the steady state.
func (t *Tx) AckNodePins(ctx context.Context, nodeID string, pins []string) error {
	ack := strings.Join(pins, "\n")
	if _, err := t.exec(ctx, "UPDATE nodes SET pins_ack = ? WHERE id = ? AND pins_ack <> ?", ack, nodeID, ack); err != nil {
		return fmt.Errorf("record the node's pins: %w", err)
	}
	return nil
}
