package hwid

import (
	"errors"
	"strings"
	"testing"
)

func split(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// FuzzNormalize: Normalize never panics, refuses only with a *ClaimError
// carrying a reason, and its output validates again, normalizes to itself
// and keeps its key. NormalizeExpect and Matches on the same strings never
// panic, and a normalized binding is a fixed point.
func FuzzNormalize(f *testing.F) {
	f.Add("4C4C4544-0042-3510-8052-B4C04F4E3732", "CZ2345ABCD", "Default string", " cz2345abcd ", "node-1",
		"3C:EC:EF:01:02:03\n02:42:ac:11:00:02\n3cec.ef01.0204", "GPU-8F0C\ngpu-abc")
	f.Add("03000200040005000006000700080009", "To Be Filled By O.E.M.", "0", "", "", "3C-EC-EF-01-02-03\n3cecef010203", "")
	f.Add("{00000000-0000-0000-0000-000000000000}", "abc\xff", "\x00", "\u202e", strings.Repeat("h", 254), "zz", " ")
	f.Add("", "ſK", "\u023a", "İ", "", "", "GPU-\u023a\nGPU-\u2c65")
	f.Fuzz(func(t *testing.T, uuid, ps, bs, cs, host, macs, gpus string) {
		c := Claims{ProductUUID: uuid, ProductSerial: ps, BoardSerial: bs, ChassisSerial: cs, Hostname: host,
			MACs: split(macs), GPUUUIDs: split(gpus)}
		n, err := Normalize(c)
		if err != nil {
			var ce *ClaimError
			if !errors.As(err, &ce) || !strings.HasPrefix(ce.Reason, "claims-") {
				t.Fatalf("Normalize error without a reason: %v", err)
			}
			if Validate(c) == nil {
				t.Fatalf("Validate accepts what Normalize refuses: %v", err)
			}
		} else {
			nc := n.Claims()
			if err := Validate(nc); err != nil {
				t.Fatalf("normalized claims %+v do not validate: %v", nc, err)
			}
			m, err := Normalize(nc)
			if err != nil || !m.Equal(n) {
				t.Fatalf("not idempotent: %+v -> %+v (%v)", nc, m.Claims(), err)
			}
			k := n.Key()
			if m.Key() != k {
				t.Fatalf("key changed on renormalization")
			}
			if k.Trusted && (!k.Present || k.Kinds < 2) || k.Present != (k.Identifiers > 0) || k.Kinds > k.Identifiers {
				t.Fatalf("inconsistent key %+v", k)
			}
			for _, mac := range n.MACs() {
				p, ok := parseMAC(mac)
				if !ok || !permanentMAC(p) || formatMAC(p) != mac {
					t.Fatalf("non-canonical MAC %q kept", mac)
				}
			}
		}

		e := Expect{ProductUUID: uuid, Serial: ps, MAC: strings.TrimSpace(macs), GPUUUID: gpus}
		ne, err := NormalizeExpect(e)
		if err == nil {
			again, err := NormalizeExpect(ne)
			if err != nil || again != ne {
				t.Fatalf("NormalizeExpect not idempotent: %+v -> %+v (%v)", ne, again, err)
			}
		}
		_ = e.Matches(n)
		_ = ne.Matches(n)
		_ = IsPlaceholder(ps)
		_ = IsPlaceholderUUID(uuid)
	})
}
