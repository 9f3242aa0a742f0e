package events

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Cursors, and the ids of events and audit rows, are sealed positions
// (R14.3).
//
// A row's position in the store is global: events and audit rows of every
// tenant take their ids from one sequence (and, on PostgreSQL, events their
// tx_order from one sequencer). Handed out as they are, the gaps between a
// tenant's own ids count the other tenants' joins, and a long poll times
// them. So what leaves the API is
//
//	prefix || base64url( AES-256(position) || HMAC-SHA256(tenant, ...)[:8] )
//
// "ev_" for events, "au_" for audit rows. AES on the one 16-byte block
// (tx_order, id) is a keyed permutation: every row gets its own string, the
// same one at every read and on every replica, and without the key the
// strings are unordered and unrelated, so neither their values nor their
// differences say how many rows lie between. The tag binds the string to
// its tenant and kind: another tenant's cursor, an audit cursor given as an
// event cursor, and anything altered are refused with the message of a
// malformed cursor, so a tenant cannot tell "not yours" from "nonsense".
// The server still orders by position: it opens the cursor and reads as
// before. An event's id is its cursor (and likewise for audit rows), so
// there is one opaque string per row.
//
// Alternatives considered: per-tenant sequence numbers give short dense
// ids, but on PostgreSQL a number taken in the writing transaction is a
// per-tenant counter row held until COMMIT, which serializes every join of
// a tenant (the hot-row cost the token slots and the event sequencer
// exist to avoid), and numbering after commit would need the sequencer for
// audit rows too and a second column on both tables. Sealing costs one AES
// block and one HMAC per row read, nothing on the write path, and no
// migration of the rows.
//
// The key is random, stored once in the database (store.StreamKey): every
// replica has it without new configuration, and it does not change when
// the PKI is rotated. It is separated per purpose by HMAC.
//
// Upgrades. Earlier versions handed out decimal ids and cursors ("42.17"
// for events, "1234" for audit). A new replica honours such a cursor only
// when it names, exactly, a row of the caller's tenant written before the
// key's legacy window closed (store.StreamKey.LegacyUntil: a day after the
// first new replica started, none at all on a database that started new):
// a client that read from an old replica resumes on a new one where it
// left off, and the answer carries sealed cursors from then on. Any other
// decimal cursor is refused: honouring arbitrary positions would let a
// tenant search the global numbering of its rows, which is what sealing
// hides. An old replica refuses sealed cursors ("not a cursor from this
// API"); during a rolling upgrade a client that moves from a new replica to
// an old one starts again from a cursor it got from an old one, or from the
// start. A downgrade is the same; running the down migration drops the key,
// and cursors sealed with it are refused after the next upgrade.

const (
	eventPrefix = "ev_"
	auditPrefix = "au_"
	tagLen      = 8
	sealedLen   = aes.BlockSize + tagLen
)

// errCursor is the answer for every cursor that is not the tenant's: the
// same for malformed, altered, foreign and expired ones.
func errCursor() error { return errs.Invalid("cursor", "not a cursor from this API") }

// Codec seals and opens positions for one deployment's key. Safe for
// concurrent use.
type Codec struct {
	event, audit cipher.Block
	mac          []byte
	key          store.StreamKey
}

// NewCodec returns the codec of key.
func NewCodec(key store.StreamKey) (*Codec, error) {
	if len(key.Key) != 32 {
		return nil, fmt.Errorf("cursor codec: key of %d bytes, want 32", len(key.Key))
	}
	derive := func(purpose string) []byte {
		m := hmac.New(sha256.New, key.Key)
		m.Write([]byte("better-compute stream cursor v1 " + purpose))
		return m.Sum(nil)
	}
	ev, err := aes.NewCipher(derive("event position"))
	if err != nil {
		return nil, fmt.Errorf("cursor codec: %w", err)
	}
	au, err := aes.NewCipher(derive("audit position"))
	if err != nil {
		return nil, fmt.Errorf("cursor codec: %w", err)
	}
	return &Codec{event: ev, audit: au, mac: derive("tag"), key: key}, nil
}

// EventCursor is the id and cursor of the tenant's event at (txOrder, id).
func (c *Codec) EventCursor(tenantID string, txOrder, id int64) string {
	return c.seal(eventPrefix, c.event, tenantID, txOrder, id)
}

// AuditCursor is the id and cursor of the tenant's audit row id.
func (c *Codec) AuditCursor(tenantID string, id int64) string {
	return c.seal(auditPrefix, c.audit, tenantID, 0, id)
}

func (c *Codec) seal(prefix string, b cipher.Block, tenantID string, x, y int64) string {
	var out [sealedLen]byte
	binary.BigEndian.PutUint64(out[:8], uint64(x))
	binary.BigEndian.PutUint64(out[8:16], uint64(y))
	b.Encrypt(out[:aes.BlockSize], out[:aes.BlockSize])
	copy(out[aes.BlockSize:], c.tag(prefix, tenantID, out[:aes.BlockSize]))
	return prefix + base64.RawURLEncoding.EncodeToString(out[:])
}

// open returns the position sealed in s for the tenant, or ok false.
func (c *Codec) open(prefix string, b cipher.Block, tenantID, s string) (x, y int64, ok bool) {
	rest, found := strings.CutPrefix(s, prefix)
	if !found || base64.RawURLEncoding.DecodedLen(len(rest)) != sealedLen {
		return 0, 0, false
	}
	raw, err := base64.RawURLEncoding.Strict().DecodeString(rest)
	if err != nil || len(raw) != sealedLen {
		return 0, 0, false
	}
	// SECURITY: the tag, checked in constant time before anything else,
	// is what makes another tenant's cursor (or an altered one) fail.
	if !hmac.Equal(raw[aes.BlockSize:], c.tag(prefix, tenantID, raw[:aes.BlockSize])) {
		return 0, 0, false
	}
	var pt [aes.BlockSize]byte
	b.Decrypt(pt[:], raw[:aes.BlockSize])
	x, y = int64(binary.BigEndian.Uint64(pt[:8])), int64(binary.BigEndian.Uint64(pt[8:]))
	return x, y, x >= 0 && y >= 0
}

// tag binds sealed to its kind (prefix) and tenant.
func (c *Codec) tag(prefix, tenantID string, sealed []byte) []byte {
	m := hmac.New(sha256.New, c.mac)
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(tenantID)))
	m.Write([]byte(prefix))
	m.Write(n[:])
	m.Write([]byte(tenantID))
	m.Write(sealed)
	return m.Sum(nil)[:tagLen]
}

// EventPosition opens a ListEvents cursor of the tenant: "" is the start of
// the stream. Only a decimal cursor of an earlier version (see above) reads
// db; any refusal is the same INVALID_ARGUMENT.
func (c *Codec) EventPosition(ctx context.Context, db *store.DB, tenantID, cursor string) (txOrder, id int64, err error) {
	if cursor == "" {
		return 0, 0, nil
	}
	if x, y, ok := c.open(eventPrefix, c.event, tenantID, cursor); ok {
		return x, y, nil
	}
	x, y, ok := store.ParseEventCursor(cursor)
	if !ok || len(cursor) > 40 {
		return 0, 0, errCursor()
	}
	return x, y, c.legacy(ctx, db, func(tx *store.Tx) (time.Time, bool, error) {
		return tx.EventCreatedAt(ctx, tenantID, x, y)
	})
}

// AuditPosition opens a ListAudit cursor of the tenant: "" is the oldest
// row. As EventPosition.
func (c *Codec) AuditPosition(ctx context.Context, db *store.DB, tenantID, cursor string) (id int64, err error) {
	if cursor == "" {
		return 0, nil
	}
	if _, y, ok := c.open(auditPrefix, c.audit, tenantID, cursor); ok {
		return y, nil
	}
	if len(cursor) > 19 {
		return 0, errCursor()
	}
	n, perr := strconv.ParseInt(cursor, 10, 64)
	if perr != nil || n <= 0 || strconv.FormatInt(n, 10) != cursor {
		return 0, errCursor()
	}
	return n, c.legacy(ctx, db, func(tx *store.Tx) (time.Time, bool, error) {
		return tx.AuditCreatedAt(ctx, tenantID, n)
	})
}

// legacy decides a decimal cursor from the row it names: honoured when the
// tenant has that row and it was written inside the legacy window.
func (c *Codec) legacy(ctx context.Context, db *store.DB, find func(*store.Tx) (time.Time, bool, error)) error {
	if c.key.LegacyUntil.IsZero() {
		return errCursor()
	}
	var created time.Time
	var found bool
	err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		created, found, err = find(tx)
		return err
	})
	if err != nil {
		return err
	}
	if !found || !created.Before(c.key.LegacyUntil) {
		return errCursor()
	}
	return nil
}
