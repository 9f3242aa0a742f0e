package hwid

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// macGen draws MACs in any accepted layout and case, some of them not
// permanent.
func macGen() *rapid.Generator[string] {
	return rapid.Custom(func(t *rapid.T) string {
		var m [6]byte
		for i := range m {
			m[i] = rapid.Byte().Draw(t, "octet")
		}
		if rapid.Bool().Draw(t, "permanent") {
			m[0] &^= 0x03
			m[5] |= 1
		}
		s := formatMAC(m)
		switch rapid.IntRange(0, 3).Draw(t, "layout") {
		case 1:
			s = strings.ReplaceAll(s, ":", "-")
		case 2:
			h := strings.ReplaceAll(s, ":", "")
			s = h[0:4] + "." + h[4:8] + "." + h[8:12]
		case 3:
			s = strings.ReplaceAll(s, ":", "")
		}
		if rapid.Bool().Draw(t, "upper") {
			s = strings.ToUpper(s)
		}
		return s
	})
}

func distinctMACs(t *rapid.T) []string {
	raw := rapid.SliceOfN(macGen(), 0, MaxMACs).Draw(t, "macs")
	seen := map[[6]byte]bool{}
	var out []string
	for _, s := range raw {
		m, _ := parseMAC(s)
		if !seen[m] {
			seen[m] = true
			out = append(out, s)
		}
	}
	return out
}

func textGen() *rapid.Generator[string] {
	return rapid.OneOf(
		rapid.SampledFrom([]string{"", " ", "To Be Filled By O.E.M.", "Default string", "0", "N/A", "CZ2345ABCD", " cz2345abcd ", "PF2ABCDE", "ſK"}),
		rapid.StringN(0, 40, MaxStringBytes),
	)
}

func claimsGen() *rapid.Generator[Claims] {
	return rapid.Custom(func(t *rapid.T) Claims {
		var c Claims
		if rapid.Bool().Draw(t, "hasUUID") {
			var u [16]byte
			for i := range u {
				u[i] = rapid.Byte().Draw(t, "uuidByte")
			}
			h := hex.EncodeToString(u[:])
			if rapid.Bool().Draw(t, "dashed") {
				h = h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
			}
			if rapid.Bool().Draw(t, "upperUUID") {
				h = strings.ToUpper(h)
			}
			c.ProductUUID = h
		}
		c.ProductSerial = textGen().Draw(t, "productSerial")
		c.BoardSerial = textGen().Draw(t, "boardSerial")
		c.ChassisSerial = textGen().Draw(t, "chassisSerial")
		c.MACs = distinctMACs(t)
		gpus := rapid.SliceOfNDistinct(rapid.StringMatching(`GPU-[0-9a-f]{1,12}`), 0, 8, strings.ToLower).Draw(t, "gpus")
		for _, g := range gpus {
			if rapid.Bool().Draw(t, "upperGPU") {
				g = strings.ToUpper(g)
			}
			c.GPUUUIDs = append(c.GPUUUIDs, g)
		}
		c.Hostname = textGen().Draw(t, "hostname")
		return c
	})
}

// R6.1: the key does not depend on the order of MACs or GPU UUIDs.
func TestPropertyKeyPermutationInvariant(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := claimsGen().Draw(t, "claims")
		n, err := Normalize(c)
		if err != nil {
			t.Skip("odd input:", err)
		}
		p := c
		p.MACs = rapid.Permutation(c.MACs).Draw(t, "macPerm")
		p.GPUUUIDs = rapid.Permutation(c.GPUUUIDs).Draw(t, "gpuPerm")
		m, err := Normalize(p)
		if err != nil {
			t.Fatalf("permuted claims refused: %v", err)
		}
		if n.Key() != m.Key() {
			t.Fatalf("key changed under permutation: %s vs %s", n.Key(), m.Key())
		}
		if !n.Equal(m) {
			t.Fatalf("normalized form changed under permutation")
		}
	})
}

// Normalize is idempotent, and its output passes Validate and keeps its key.
func TestPropertyNormalizeIdempotent(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := claimsGen().Draw(t, "claims")
		n, err := Normalize(c)
		if err != nil {
			var ce *ClaimError
			if !errors.As(err, &ce) || ce.Reason == "" {
				t.Fatalf("error without reason: %v", err)
			}
			return
		}
		if err := Validate(n.Claims()); err != nil {
			t.Fatalf("normalized claims do not validate: %v", err)
		}
		m, err := Normalize(n.Claims())
		if err != nil || !m.Equal(n) || m.Key() != n.Key() {
			t.Fatalf("not idempotent: %+v -> %+v (%v)", n.Claims(), m.Claims(), err)
		}
	})
}

// R5.1, R5.2: a binding made from a machine's own (non-placeholder)
// identifiers, in any format, matches it.
func TestPropertyExpectFromClaimsMatches(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := claimsGen().Draw(t, "claims")
		n, err := Normalize(c)
		if err != nil {
			t.Skip("odd input:", err)
		}
		var e Expect
		if c.ProductUUID != "" && !IsPlaceholderUUID(c.ProductUUID) && rapid.Bool().Draw(t, "bindUUID") {
			e.ProductUUID = c.ProductUUID
		}
		serials := []string{c.ProductSerial, c.BoardSerial, c.ChassisSerial}
		if s := serials[rapid.IntRange(0, 2).Draw(t, "serialSlot")]; strings.TrimSpace(s) != "" && !IsPlaceholder(s) {
			e.Serial = strings.ToUpper(s)
			// Upper-casing made it odd (e.g. longer), or another serial:
			// matching is case-insensitive by Unicode simple folding
			// (strings.EqualFold), under which ToUpper("ı") = "I" is not
			// the same letter.
			if _, err := NormalizeExpect(Expect{Serial: e.Serial}); err != nil || !strings.EqualFold(e.Serial, s) {
				e.Serial = s
			}
		}
		if macs := n.MACs(); len(macs) > 0 {
			raw := macs[rapid.IntRange(0, len(macs)-1).Draw(t, "mac")]
			if !IsPlaceholder(raw) {
				e.MAC = strings.ToUpper(strings.ReplaceAll(raw, ":", "-"))
			}
		}
		if len(c.GPUUUIDs) > 0 && !gpuPlaceholder(fold(c.GPUUUIDs[0])) {
			e.GPUUUID = strings.ToUpper(c.GPUUUIDs[0])
			if !strings.EqualFold(e.GPUUUID, c.GPUUUIDs[0]) {
				e.GPUUUID = c.GPUUUIDs[0] // see the serial above
			}
		}
		if _, err := NormalizeExpect(e); err != nil {
			t.Fatalf("binding from claims refused: %v", err)
		}
		if f := e.Mismatch(n); f != "" {
			t.Fatalf("binding %+v from the machine's claims does not match on %s", e, f)
		}
	})
}

// realUUID draws a product UUID that is not a placeholder, in any accepted
// form.
func realUUID() *rapid.Generator[string] {
	return rapid.Custom(func(t *rapid.T) string {
		var u [16]byte
		for i := range u {
			u[i] = rapid.Byte().Draw(t, "uuidByte")
		}
		h := hex.EncodeToString(u[:])
		if rapid.Bool().Draw(t, "dashed") {
			h = h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
		}
		if rapid.Bool().Draw(t, "upper") {
			h = strings.ToUpper(h)
		}
		if IsPlaceholderUUID(h) {
			t.Skip("drew a placeholder UUID")
		}
		return h
	})
}

// realSerial draws a serial that is not a placeholder.
func realSerial() *rapid.Generator[string] {
	return rapid.StringMatching(`[A-Za-z0-9][A-Za-z0-9-]{3,15}`).Filter(func(s string) bool { return !IsPlaceholder(s) })
}

var (
	placeholderSerials = []string{"To Be Filled By O.E.M.", "Default string", "System Serial Number", "Chassis Serial Number", "0", "N/A", "xxxxxxxx", "0000-0000", " "}
	placeholderUUIDs   = []string{"00000000-0000-0000-0000-000000000000", "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF", "03000200-0400-0500-0006-000700080009", "11111111111111111111111111111111"}
	// Well-formed permanent MACs that are placeholders (one repeated
	// character), and MACs that are not permanent at all.
	placeholderMACs = []string{"44:44:44:44:44:44", "CC-CC-CC-CC-CC-CC", "00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff", "02:42:ac:11:00:02"}
	placeholderGPUs = []string{"GPU-00000000-0000-0000-0000-000000000000", "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff", "N/A"}
)

// parts draws a machine's replaceable parts: MACs and GPU UUIDs.
func parts(t *rapid.T, label string) ([]string, []string) {
	macs := distinctMACs(t)
	gpus := rapid.SliceOfNDistinct(rapid.StringMatching(`GPU-[0-9a-f]{8}-[0-9a-f]{4}`), 0, 8, strings.ToLower).Draw(t, label+"gpus")
	return macs, gpus
}

// stableMachine draws a machine with a real product UUID and at least one
// real serial, in some slot, with placeholders in others, and any parts.
func stableMachine(t *rapid.T) Claims {
	c := Claims{ProductUUID: realUUID().Draw(t, "uuid")}
	slots := []*string{&c.ProductSerial, &c.BoardSerial, &c.ChassisSerial}
	real := rapid.IntRange(0, 2).Draw(t, "realSlot")
	for i, s := range slots {
		switch {
		case i == real:
			*s = realSerial().Draw(t, "serial")
		case rapid.Bool().Draw(t, "otherReal"):
			*s = realSerial().Draw(t, "otherSerial")
		default:
			*s = rapid.SampledFrom(placeholderSerials).Draw(t, "placeholderSerial")
		}
	}
	c.MACs, c.GPUUUIDs = parts(t, "")
	c.Hostname = hostnameGen().Draw(t, "hostname")
	return c
}

func hostnameGen() *rapid.Generator[string] {
	return rapid.StringMatching(`[a-z0-9-]{0,20}`)
}

// R6.3: a machine that kept its product UUID and a serial keeps its key,
// trusted and stable, whatever happened to its NICs and GPUs (replaced,
// added, removed) and its hostname.
func TestPropertyPartSwapKeepsStableKey(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		before := stableMachine(t)
		after := before
		after.MACs, after.GPUUUIDs = parts(t, "new")
		after.Hostname = hostnameGen().Draw(t, "newHostname")
		a, b := key2(t, before), key2(t, after)
		if !a.Stable || !a.Trusted || a.PlaceholderHardware() {
			t.Fatalf("a machine with a real UUID and serial has key %+v", a)
		}
		if a != b {
			// Kinds and Identifiers may differ with the parts; the name
			// may not.
			if a.Hash != b.Hash || !b.Stable || !b.Trusted || b.PlaceholderHardware() {
				t.Fatalf("part swap changed the key: %+v -> %+v", a, b)
			}
		}
	})
}

// key2 is KeyOf for property tests; generated claims are always valid.
func key2(t *rapid.T, c Claims) HardwareKey {
	k, err := KeyOf(c)
	if err != nil {
		t.Fatalf("KeyOf(%+v): %v", c, err)
	}
	return k
}

// model is what a hardware key names, computed independently of Key: the
// kind of key and the set of identifiers it stands for.
func model(t *rapid.T, c Claims) (stable bool, ids map[string]bool) {
	n, err := Normalize(c)
	if err != nil {
		t.Fatalf("Normalize: %v", err)
	}
	nc := n.Claims()
	stableIDs, all := map[string]bool{}, map[string]bool{}
	hasUUID := false
	if !IsPlaceholderUUID(nc.ProductUUID) {
		stableIDs["uuid "+nc.ProductUUID] = true
		hasUUID = true
	}
	hasSerial := false
	for _, s := range []string{nc.ProductSerial, nc.BoardSerial, nc.ChassisSerial} {
		if !IsPlaceholder(s) {
			stableIDs["serial "+fold(s)] = true
			hasSerial = true
		}
	}
	for k := range stableIDs {
		all[k] = true
	}
	for _, m := range nc.MACs {
		if !IsPlaceholder(m) {
			all["mac "+m] = true
		}
	}
	for _, g := range nc.GPUUUIDs {
		if !gpuPlaceholder(g) {
			all["gpu "+g] = true
		}
	}
	if hasUUID && hasSerial {
		return true, stableIDs
	}
	return false, all
}

func sameSet(a, b map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// R6.1, R6.3: distinct machines do not collide. Two machines get one key
// exactly when the key names the same identifiers the same way; in
// particular machines with different stable identifiers never share a key,
// however many parts they share (a NIC moved from one to the other).
func TestPropertyDistinctMachinesDoNotCollide(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		gen := rapid.OneOf(claimsGen(), rapid.Custom(stableMachine))
		a := gen.Draw(t, "a")
		var b Claims
		switch rapid.IntRange(0, 2).Draw(t, "relation") {
		case 0: // an unrelated machine
			b = gen.Draw(t, "b")
		case 1: // another board with a's parts
			b = stableMachine(t)
			b.MACs, b.GPUUUIDs = a.MACs, a.GPUUUIDs
		case 2: // a's board with other parts
			b = a
			b.MACs, b.GPUUUIDs = parts(t, "b")
		}
		if _, err := Normalize(a); err != nil {
			t.Skip("odd input:", err)
		}
		if _, err := Normalize(b); err != nil {
			t.Skip("odd input:", err)
		}
		ka, kb := key2(t, a), key2(t, b)
		sa, ia := model(t, a)
		sb, ib := model(t, b)
		if ka.Stable != sa || kb.Stable != sb {
			t.Fatalf("stable %v/%v, model says %v/%v", ka.Stable, kb.Stable, sa, sb)
		}
		same := sa == sb && sameSet(ia, ib)
		if (ka.Hash == kb.Hash) != same {
			t.Fatalf("keys equal = %v, but the machines name %v and %v (stable %v, %v)", ka.Hash == kb.Hash, ia, ib, sa, sb)
		}
		if ka.Present && kb.Present && sa && sb && !sameSet(ia, ib) && ka.Hash == kb.Hash {
			t.Fatalf("two boards share a key")
		}
	})
}

// R6.1, R6.2, R5.2: placeholders never count. Adding placeholder values to
// empty slots (serials, product UUID, MACs, GPU UUIDs) changes nothing about
// the key: not the hash, not trust, not stability, not the placeholder
// hardware rule. And a placeholder product UUID or serial never makes a key
// stable.
func TestPropertyPlaceholdersNeverCount(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := rapid.OneOf(claimsGen(), rapid.Custom(stableMachine)).Draw(t, "claims")
		if _, err := Normalize(c); err != nil {
			t.Skip("odd input:", err)
		}
		want := key2(t, c)
		p := c
		if p.ProductUUID == "" || IsPlaceholderUUID(p.ProductUUID) {
			p.ProductUUID = rapid.SampledFrom(placeholderUUIDs).Draw(t, "placeholderUUID")
		}
		for i, s := range []*string{&p.ProductSerial, &p.BoardSerial, &p.ChassisSerial} {
			if IsPlaceholder(*s) {
				*s = rapid.SampledFrom(placeholderSerials).Draw(t, "placeholderSerial"+string(rune('0'+i)))
			}
		}
		have := map[[6]byte]bool{}
		for _, m := range p.MACs {
			mm, _ := parseMAC(strings.TrimSpace(m))
			have[mm] = true
		}
		p.MACs = append([]string(nil), p.MACs...)
		for _, m := range rapid.SliceOfDistinct(rapid.SampledFrom(placeholderMACs), func(s string) string { return s }).Draw(t, "placeholderMACs") {
			mm, _ := parseMAC(m)
			if !have[mm] && len(p.MACs) < MaxMACs {
				have[mm] = true
				p.MACs = append(p.MACs, m)
			}
		}
		gpus := map[string]bool{}
		for _, g := range p.GPUUUIDs {
			gpus[fold(strings.TrimSpace(g))] = true
		}
		p.GPUUUIDs = append([]string(nil), p.GPUUUIDs...)
		if g := rapid.SampledFrom(placeholderGPUs).Draw(t, "placeholderGPU"); !gpus[fold(g)] {
			p.GPUUUIDs = append(p.GPUUUIDs, g)
		}
		got := key2(t, p)
		if got.Hash != want.Hash || got.Present != want.Present || got.Trusted != want.Trusted || got.Stable != want.Stable ||
			got.Kinds != want.Kinds || got.Identifiers != want.Identifiers || got.HasUUIDOrSerial != want.HasUUIDOrSerial ||
			got.PlaceholderHardware() != want.PlaceholderHardware() {
			t.Fatalf("placeholders changed the key: %+v -> %+v", want, got)
		}

		// Only placeholders where the stable identifiers would be: never
		// stable, and placeholder hardware (R6.2) unless both kinds of part
		// are left... which still has no UUID or serial.
		q := Claims{
			ProductUUID:   rapid.SampledFrom(placeholderUUIDs).Draw(t, "qUUID"),
			ProductSerial: rapid.SampledFrom(placeholderSerials).Draw(t, "qSerial"),
			BoardSerial:   rapid.SampledFrom(placeholderSerials).Draw(t, "qBoard"),
			MACs:          c.MACs, GPUUUIDs: c.GPUUUIDs,
		}
		if k := key2(t, q); k.Stable || k.HasUUIDOrSerial || !k.PlaceholderHardware() {
			t.Fatalf("placeholder UUID and serials gave %+v", k)
		}
	})
}
