package hwid

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
)

// keyDomain separates hardware-key hashes from every other SHA-256 in the
// product. Changing the encoding below needs a new version here.
const keyDomain = "better-compute hwkey v1"

// Identifier kinds, as tagged in the key encoding.
const (
	kindUUID   = "uuid"
	kindSerial = "serial"
	kindMAC    = "mac"
	kindGPU    = "gpu"
)

// HardwareKey is the key of a machine derived from its claims (R6.1). It
// is the same whether JoinService derives it from join claims or the
// Inventory controller from inventory.
type HardwareKey struct {
	// Hash is SHA-256 over the identifiers left once placeholders are
	// dropped; all zero when Present is false.
	Hash [32]byte
	// Present is false when no identifier is left: the machine has no key.
	Present bool
	// Trusted is true when at least two independent kinds of identifier
	// are left (see Kinds). Only a trusted key may reclaim a node (R6.3).
	Trusted bool
	// Identifiers counts the identifier values hashed.
	Identifiers int
	// Kinds counts the independent kinds among them.
	//
	// The kinds are: the product UUID; a serial (product, board or chassis,
	// counted once: vendors often copy one into another, and they come from
	// the same firmware tables); the permanent MACs (counted once however
	// many NICs: a machine with two onboard NICs is still identified by
	// one part); the GPU UUIDs (counted once, likewise). So two MACs alone
	// do not make a trusted key, but a product UUID and a MAC do.
	Kinds int
	// HasUUIDOrSerial is true when a product UUID or a serial is left. A
	// token join without one is placeholder hardware (R6.2).
	HasUUIDOrSerial bool
}

// Hex returns Hash in lower-case hex, or "" when the key is missing.
func (k HardwareKey) Hex() string {
	if !k.Present {
		return ""
	}
	return hex.EncodeToString(k.Hash[:])
}

// String returns Hex, or "none" when the key is missing.
func (k HardwareKey) String() string {
	if !k.Present {
		return "none"
	}
	return k.Hex()
}

// PlaceholderHardware reports whether a join-token join with this key is
// placeholder hardware (R6.2): the key is missing or untrusted, or neither a
// product UUID nor a serial survived. Such a join is refused
// (placeholder-hardware) unless the token has an expect binding.
func (k HardwareKey) PlaceholderHardware() bool {
	return !k.Present || !k.Trusted || !k.HasUUIDOrSerial
}

type ident struct{ kind, value string }

// identifiers returns n's identifiers with placeholders dropped, deduplicated
// and sorted by kind, then value.
func (n Normalized) identifiers() []ident {
	var ids []ident
	if u := n.c.ProductUUID; u != "" && !IsPlaceholderUUID(u) {
		ids = append(ids, ident{kindUUID, u})
	}
	for _, s := range []string{n.c.ProductSerial, n.c.BoardSerial, n.c.ChassisSerial} {
		if s != "" && !IsPlaceholder(s) {
			ids = append(ids, ident{kindSerial, fold(s)})
		}
	}
	for _, m := range n.c.MACs {
		if !IsPlaceholder(m) {
			ids = append(ids, ident{kindMAC, m})
		}
	}
	for _, g := range n.c.GPUUUIDs {
		if !gpuPlaceholder(g) {
			ids = append(ids, ident{kindGPU, g})
		}
	}
	slices.SortFunc(ids, func(a, b ident) int {
		return cmp.Or(cmp.Compare(a.kind, b.kind), cmp.Compare(a.value, b.value))
	})
	return slices.Compact(ids)
}

// gpuPlaceholder reports whether a folded GPU UUID is a placeholder, with or
// without its "gpu-" prefix ("GPU-00000000-0000-0000-0000-000000000000").
func gpuPlaceholder(g string) bool {
	if len(g) > 4 && g[:4] == "gpu-" && IsPlaceholder(g[4:]) {
		return true
	}
	return IsPlaceholder(g)
}

// Key derives the hardware key of n (R6.1). Placeholder values are dropped
// first. The hash is SHA-256 over a canonical encoding: the domain string
// "better-compute hwkey v1", the number of identifiers, then each
// identifier as its kind ("uuid", "serial", "mac", "gpu") and value, sorted
// by kind then value, every string length-prefixed (4 bytes, big endian)
// and the count likewise. Values are the normalized forms: product UUID
// lower case dashed; each distinct serial case-folded (so the same serial
// in two slots counts once, and the slot does not matter); each permanent
// MAC lower case colon separated; each GPU UUID case-folded. The hostname is
// not an identifier. The key is thus stable under reordering, case and
// separators of the claims.
func (n Normalized) Key() HardwareKey {
	ids := n.identifiers()
	if len(ids) == 0 {
		return HardwareKey{}
	}
	k := HardwareKey{Present: true, Identifiers: len(ids)}
	h := sha256.New()
	var buf [4]byte
	put := func(s string) {
		binary.BigEndian.PutUint32(buf[:], uint32(len(s)))
		h.Write(buf[:])
		h.Write([]byte(s))
	}
	put(keyDomain)
	binary.BigEndian.PutUint32(buf[:], uint32(len(ids)))
	h.Write(buf[:])
	last := ""
	for _, id := range ids {
		put(id.kind)
		put(id.value)
		if id.kind != last {
			k.Kinds++
			last = id.kind
		}
		if id.kind == kindUUID || id.kind == kindSerial {
			k.HasUUIDOrSerial = true
		}
	}
	h.Sum(k.Hash[:0])
	k.Trusted = k.Kinds >= 2
	return k
}

// KeyOf normalizes c and derives its hardware key: the one function
// JoinService and the Inventory controller share (R6.1). The error is
// Normalize's *ClaimError.
func KeyOf(c Claims) (HardwareKey, error) {
	n, err := Normalize(c)
	if err != nil {
		return HardwareKey{}, err
	}
	return n.Key(), nil
}
