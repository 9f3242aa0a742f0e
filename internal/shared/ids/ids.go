// Package ids makes the prefixed, time-sortable identifiers used for every
// record (jt_…, jreq_…, node_…): a prefix, an underscore and 26 characters of
// lower-case Crockford base32 over 48 bits of milliseconds and 80 random bits.
// Sorting ids as strings sorts them by creation time, which keeps list cursors
// and B-tree inserts cheap.
package ids

import (
	"crypto/rand"
	"encoding/binary"
	"strings"
	"time"
)

const alphabet = "0123456789abcdefghjkmnpqrstvwxyz"

// Prefixes of the identifiers in use.
const (
	Tenant      = "tn"
	Site        = "site"
	Pool        = "pool"
	Principal   = "prn"
	APIKey      = "key"
	JoinToken   = "jt"
	JoinRequest = "jreq"
	Node        = "node"
	Command     = "cmd"
)

// New returns a new id with the given prefix, stamped with t.
func New(prefix string, t time.Time) string {
	var b [16]byte
	binary.BigEndian.PutUint64(b[0:8], uint64(t.UnixMilli())<<16)
	if _, err := rand.Read(b[6:]); err != nil {
		panic("ids: crypto/rand failed: " + err.Error())
	}
	return prefix + "_" + encode(b)
}

// encode writes 128 bits as 26 base32 characters (the first carries 3 bits).
func encode(b [16]byte) string {
	hi := binary.BigEndian.Uint64(b[0:8])
	lo := binary.BigEndian.Uint64(b[8:16])
	var out [26]byte
	for i := 25; i >= 0; i-- {
		out[i] = alphabet[lo&31]
		lo = lo>>5 | hi<<59
		hi >>= 5
	}
	return string(out[:])
}

// Valid reports whether s is a well-formed id with the given prefix.
func Valid(prefix, s string) bool {
	rest, ok := strings.CutPrefix(s, prefix+"_")
	if !ok || len(rest) != 26 || rest[0] > '7' {
		return false
	}
	for i := 0; i < len(rest); i++ {
		if strings.IndexByte(alphabet, rest[i]) < 0 {
			return false
		}
	}
	return true
}
