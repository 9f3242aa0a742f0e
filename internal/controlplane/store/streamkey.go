package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// StreamKey is the secret that seals event and audit positions into the
// ids and cursors a tenant sees (internal/controlplane/events, cursor.go, says why). It
// lives in the database, so every replica has the same one and a restored
// backup keeps its cursors; it is not derived from the PKI, whose keys may
// be absent (tests, a store without a bundle) or replaced.
type StreamKey struct {
	Key []byte // 32 random bytes
	// LegacyUntil: decimal cursors of earlier versions name rows written
	// before it (zero: none are honoured).
	LegacyUntil time.Time
}

// legacyWindow is how long after the key is made rows written by older
// replicas still running (a rolling upgrade) can be named by the decimal
// cursors those replicas hand out.
const legacyWindow = 24 * time.Hour

// StreamKey returns the key loaded when the database was opened.
func (db *DB) StreamKey() StreamKey { return db.streamKey }

// loadStreamKey reads the stream key, making it first when no replica did.
// Replicas starting together insert at most one row (the primary key) and
// all read that one.
func (db *DB) loadStreamKey(ctx context.Context) error {
	k, err := db.readStreamKey(ctx)
	if errors.Is(err, sql.ErrNoRows) {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			return fmt.Errorf("make the stream key: %w", err)
		}
		// The legacy window opens only when rows exist that an earlier
		// version may have handed out decimal cursors for.
		err = db.WithTx(ctx, func(tx *Tx) error {
			_, err := tx.exec(ctx, `INSERT INTO stream_key (id, key, legacy_until_ms)
				SELECT 1, ?, CASE WHEN EXISTS (SELECT 1 FROM events) OR EXISTS (SELECT 1 FROM audit) THEN compute_now() + ? ELSE 0 END
				WHERE NOT EXISTS (SELECT 1 FROM stream_key)
				ON CONFLICT (id) DO NOTHING`, key, legacyWindow.Milliseconds())
			return err
		})
		if err != nil {
			return fmt.Errorf("store the stream key: %w", err)
		}
		k, err = db.readStreamKey(ctx)
	}
	if err != nil {
		return fmt.Errorf("read the stream key: %w", err)
	}
	db.streamKey = k
	return nil
}

func (db *DB) readStreamKey(ctx context.Context) (StreamKey, error) {
	var k StreamKey
	err := db.ReadTx(ctx, func(tx *Tx) error {
		var until int64
		if err := tx.queryRow(ctx, "SELECT key, legacy_until_ms FROM stream_key WHERE id = 1").Scan(&k.Key, &until); err != nil {
			return err
		}
		if until > 0 {
			k.LegacyUntil = fromMS(until)
		}
		return nil
	})
	if err == nil && len(k.Key) != 32 {
		err = fmt.Errorf("stream key of %d bytes", len(k.Key))
	}
	return k, err
}

// EventCreatedAt reports whether the tenant has a readable event at the
// position (txOrder, id) and when it was written: a decimal cursor of an
// earlier version is honoured only when it names such an event.
func (t *Tx) EventCreatedAt(ctx context.Context, tenantID string, txOrder, id int64) (time.Time, bool, error) {
	return t.createdAt(ctx, "SELECT created_ms FROM events WHERE id = ? AND tenant_id = ? AND tx_order = ?", id, tenantID, txOrder)
}

// AuditCreatedAt is EventCreatedAt for the audit row id.
func (t *Tx) AuditCreatedAt(ctx context.Context, tenantID string, id int64) (time.Time, bool, error) {
	return t.createdAt(ctx, "SELECT created_ms FROM audit WHERE id = ? AND tenant_id = ?", id, tenantID)
}

func (t *Tx) createdAt(ctx context.Context, q string, args ...any) (time.Time, bool, error) {
	var ms int64
	err := t.queryRow(ctx, q, args...).Scan(&ms)
	if errors.Is(err, sql.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("find the row a cursor names: %w", err)
	}
	return fromMS(ms), true, nil
}
