package hwid

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
)

// The key's domain strings separate hardware-key hashes from every other
// SHA-256 in the product, and the two derivations from each other. Changing
// an encoding below needs a new domain string.
const (
	// keyDomain is the full key: every identifier left.
	keyDomain = "better-compute hwkey v1"
	// stableKeyDomain is the stable key: the product UUID and the serials
	// only (see Key).
	stableKeyDomain = "better-compute hwkey stable v1"
)

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
	// Hash is SHA-256 over the identifiers the key is derived from (all of
	// them, or only the stable ones: see Stable); all zero when Present is
	// false.
	Hash [32]byte
	// Present is false when no identifier is left: the machine has no key.
	Present bool
	// Trusted is true when at least two independent kinds of identifier
	// are left (see Kinds). Only a trusted key may reclaim a node (R6.3).
	Trusted bool
	// Stable is true when Hash covers only the product UUID and the
	// serials, because both kinds are left: replacing a NIC or a GPU then
	// keeps the key (R6.3). A stable key is always trusted.
	Stable bool
	// Identifiers counts the identifier values left once placeholders are
	// dropped, whether or not the hash covers them.
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

// Key derives the hardware key of n (R6.1, R6.3).
//
// Placeholder values are dropped first (IsPlaceholder, IsPlaceholderUUID;
// the hostname is never an identifier). Of the identifiers left, the
// product UUID and the serials are the machine's stable identifiers: they
// live in the mainboard's firmware and change only with the board. The
// permanent MACs and the GPU UUIDs belong to replaceable parts. The key is:
//
//   - stable, when a product UUID and a serial are both left (two
//     independent kinds, so trusted): the hash covers those two kinds only.
//     A machine whose NIC or GPU was replaced, added or removed keeps its
//     key, and so stays its node (a reinstall after the swap reclaims it);
//   - full, otherwise: the hash covers every identifier left, and the MACs
//     and GPU UUIDs count towards the two kinds a trusted key needs. Such a
//     machine has at most one stable identifier, and one identifier alone is
//     too weak a name (cloned VMs share product UUIDs, some vendors reuse
//     serials), so its replaceable parts are part of its name: after a NIC
//     or GPU swap it is a new machine, and the old node is retired by hand.
//
// Trust is decided the same way in both cases: at least two independent
// kinds left (see HardwareKey.Kinds).
//
// The hash is SHA-256 over a canonical encoding: the domain string
// ("better-compute hwkey stable v1" for a stable key, "better-compute hwkey
// v1" for a full one), the number of identifiers hashed, then each as its
// kind ("uuid", "serial", "mac", "gpu") and value, sorted by kind then
// value, every string length-prefixed (4 bytes, big endian) and the count
// likewise. Values are the normalized forms: product UUID lower case dashed;
// each distinct serial case-folded (so the same serial in two slots counts
// once, and the slot does not matter); each permanent MAC lower case colon
// separated; each GPU UUID case-folded. The key is thus stable under
// reordering, case and separators of the claims. The two domains keep a
// stable key from ever equalling a full one.
func (n Normalized) Key() HardwareKey {
	ids := n.identifiers()
	if len(ids) == 0 {
		return HardwareKey{}
	}
	k := HardwareKey{Present: true, Identifiers: len(ids)}
	var hasUUID, hasSerial bool
	last := ""
	for _, id := range ids {
		if id.kind != last {
			k.Kinds++
			last = id.kind
		}
		hasUUID = hasUUID || id.kind == kindUUID
		hasSerial = hasSerial || id.kind == kindSerial
	}
	k.HasUUIDOrSerial = hasUUID || hasSerial
	k.Trusted = k.Kinds >= 2
	k.Stable = hasUUID && hasSerial
	domain, hashed := keyDomain, ids
	if k.Stable {
		domain, hashed = stableKeyDomain, stableOnly(ids)
	}
	k.Hash = hashIdentifiers(domain, hashed)
	return k
}

// stableOnly returns the product UUID and serials among ids, in order.
func stableOnly(ids []ident) []ident {
	out := make([]ident, 0, len(ids))
	for _, id := range ids {
		if id.kind == kindUUID || id.kind == kindSerial {
			out = append(out, id)
		}
	}
	return out
}

// hashIdentifiers is the canonical encoding described at Key.
func hashIdentifiers(domain string, ids []ident) [32]byte {
	h := sha256.New()
	var buf [4]byte
	put := func(s string) {
		binary.BigEndian.PutUint32(buf[:], uint32(len(s)))
		h.Write(buf[:])
		h.Write([]byte(s))
	}
	put(domain)
	binary.BigEndian.PutUint32(buf[:], uint32(len(ids)))
	h.Write(buf[:])
	for _, id := range ids {
		put(id.kind)
		put(id.value)
	}
	var sum [32]byte
	h.Sum(sum[:0])
	return sum
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
