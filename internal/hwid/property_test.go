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
			if _, err := NormalizeExpect(Expect{Serial: e.Serial}); err != nil {
				e.Serial = s // upper-casing made it odd (e.g. longer)
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
		}
		if _, err := NormalizeExpect(e); err != nil {
			t.Fatalf("binding from claims refused: %v", err)
		}
		if f := e.Mismatch(n); f != "" {
			t.Fatalf("binding %+v from the machine's claims does not match on %s", e, f)
		}
	})
}
