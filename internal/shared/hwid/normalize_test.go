package hwid

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
)

func mustNormalize(t *testing.T, c Claims) Normalized {
	t.Helper()
	n, err := Normalize(c)
	if err != nil {
		t.Fatalf("Normalize(%+v): %v", c, err)
	}
	return n
}

// R5.2, R6.1: the canonical forms the key and the expect binding compare.
func TestNormalize(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   Claims
		want Claims
	}{
		{"R5.2 uuid upper case dashed", Claims{ProductUUID: "4C4C4544-0042-3510-8052-B4C04F4E3732"},
			Claims{ProductUUID: "4c4c4544-0042-3510-8052-b4c04f4e3732"}},
		{"R5.2 uuid undashed", Claims{ProductUUID: "4C4C4544004235108052B4C04F4E3732"},
			Claims{ProductUUID: "4c4c4544-0042-3510-8052-b4c04f4e3732"}},
		{"R5.2 uuid braces and spaces", Claims{ProductUUID: " {4C4C4544-0042-3510-8052-B4C04F4E3732} "},
			Claims{ProductUUID: "4c4c4544-0042-3510-8052-b4c04f4e3732"}},
		{"R5.2 placeholder uuid kept in the record", Claims{ProductUUID: "03000200-0400-0500-0006-000700080009"},
			Claims{ProductUUID: "03000200-0400-0500-0006-000700080009"}},
		{"R5.2 serials trimmed, case kept", Claims{ProductSerial: "  AbC123  ", BoardSerial: " ", ChassisSerial: "x"},
			Claims{ProductSerial: "AbC123", ChassisSerial: "x"}},
		{"R5.2 mac separators and case", Claims{MACs: []string{"AA:BB:CC:00:11:22", "a8-bb-cc-00-11-23", "A4BB.CC00.1124", "A0BBCC001125", " a0:bb:cc:00:11:26 "}},
			Claims{MACs: []string{"a0:bb:cc:00:11:25", "a0:bb:cc:00:11:26", "a4:bb:cc:00:11:24", "a8:bb:cc:00:11:23"}}},
		{"R5.2 locally administered, multicast and zero macs ignored", Claims{MACs: []string{"02:42:ac:11:00:02", "01:00:5e:00:00:01", "ff:ff:ff:ff:ff:ff", "00:00:00:00:00:00", "3c:ec:ef:01:02:03"}},
			Claims{MACs: []string{"3c:ec:ef:01:02:03"}}},
		{"R5.2 gpu uuids lower case, sorted", Claims{GPUUUIDs: []string{"GPU-B2C3D4E5-0000-1111-2222-333344445555", " GPU-8F0C1D2E-AAAA-BBBB-CCCC-DDDDEEEEFFFF"}},
			Claims{GPUUUIDs: []string{"gpu-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff", "gpu-b2c3d4e5-0000-1111-2222-333344445555"}}},
		{"hostname trimmed", Claims{Hostname: " node-1.example "}, Claims{Hostname: "node-1.example"}},
		{"empty", Claims{}, Claims{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := mustNormalize(t, tc.in)
			if diff := cmp.Diff(tc.want, n.Claims()); diff != "" {
				t.Errorf("Normalize (-want +got):\n%s", diff)
			}
			again := mustNormalize(t, n.Claims())
			if !again.Equal(n) {
				t.Errorf("not idempotent: %+v then %+v", n.Claims(), again.Claims())
			}
		})
	}
}

// Odd input refuses the join with a short machine reason.
func TestNormalizeRefusesOddInput(t *testing.T) {
	macs := func(n int) []string {
		var out []string
		for i := range n {
			out = append(out, formatMAC([6]byte{0x3c, 0xec, 0xef, 0, byte(i >> 8), byte(i)}))
		}
		return out
	}
	gpus := func(n int) []string {
		var out []string
		for i := range n {
			out = append(out, "GPU-"+strings.Repeat("a", i+1))
		}
		return out
	}
	for _, tc := range []struct {
		name   string
		in     Claims
		reason string
		field  string
	}{
		{"invalid utf-8", Claims{ProductSerial: "abc\xff"}, ReasonInvalidUTF8, "productSerial"},
		{"invalid utf-8 in mac", Claims{MACs: []string{"3c:ec:ef:01:02:03", "\xc0"}}, ReasonInvalidUTF8, "macs[1]"},
		{"control char", Claims{BoardSerial: "abc\x00def"}, ReasonControlChar, "boardSerial"},
		{"newline", Claims{Hostname: "a\nb"}, ReasonControlChar, "hostname"},
		{"DEL", Claims{ChassisSerial: "abc\x7f"}, ReasonControlChar, "chassisSerial"},
		{"C1 control", Claims{ChassisSerial: "abc\u0085"}, ReasonControlChar, "chassisSerial"},
		{"bidi override", Claims{ProductSerial: "abc\u202edef"}, ReasonControlChar, "productSerial"},
		{"zero width space", Claims{GPUUUIDs: []string{"GPU-\u200b1"}}, ReasonControlChar, "gpuUuids[0]"},
		{"line separator", Claims{ProductSerial: "a\u2028b"}, ReasonControlChar, "productSerial"},
		{"serial too long", Claims{ProductSerial: strings.Repeat("a", MaxStringBytes+1)}, ReasonTooLong, "productSerial"},
		{"uuid too long", Claims{ProductUUID: strings.Repeat(" ", MaxStringBytes+1)}, ReasonTooLong, "productUuid"},
		{"hostname too long", Claims{Hostname: strings.Repeat("h", MaxHostnameBytes+1)}, ReasonTooLong, "hostname"},
		{"gpu too long once lower-cased", Claims{GPUUUIDs: []string{strings.Repeat("\u023a", MaxStringBytes/2)}}, ReasonTooLong, "gpuUuids[0]"},
		{"too many macs", Claims{MACs: macs(MaxMACs + 1)}, ReasonTooMany, "macs"},
		{"too many gpus", Claims{GPUUUIDs: gpus(MaxGPUUUIDs + 1)}, ReasonTooMany, "gpuUuids"},
		{"duplicate mac after normalization", Claims{MACs: []string{"3C:EC:EF:01:02:03", "3cec.ef01.0203"}}, ReasonDuplicateMAC, "macs[1]"},
		{"duplicate locally administered mac", Claims{MACs: []string{"02:00:00:00:00:01", "02-00-00-00-00-01"}}, ReasonDuplicateMAC, "macs[1]"},
		{"duplicate gpu case-insensitively", Claims{GPUUUIDs: []string{"GPU-ABC", "gpu-abc"}}, ReasonDuplicateGPU, "gpuUuids[1]"},
		{"bad mac short", Claims{MACs: []string{"3c:ec:ef:01:02"}}, ReasonBadMAC, "macs[0]"},
		{"bad mac mixed separators", Claims{MACs: []string{"3c:ec-ef:01:02:03"}}, ReasonBadMAC, "macs[0]"},
		{"bad mac not hex", Claims{MACs: []string{"3c:ec:ef:01:02:0g"}}, ReasonBadMAC, "macs[0]"},
		{"bad mac eui-64", Claims{MACs: []string{"3c:ec:ef:01:02:03:04:05"}}, ReasonBadMAC, "macs[0]"},
		{"empty mac", Claims{MACs: []string{""}}, ReasonBadMAC, "macs[0]"},
		{"bad uuid", Claims{ProductUUID: "4c4c4544-0042-3510-8052-b4c04f4e373"}, ReasonBadUUID, "productUuid"},
		{"bad uuid dashes misplaced", Claims{ProductUUID: "4c4c454-40042-3510-8052-b4c04f4e3732"}, ReasonBadUUID, "productUuid"},
		{"bad uuid placeholder text", Claims{ProductUUID: "Not Settable"}, ReasonBadUUID, "productUuid"},
		{"blank gpu uuid", Claims{GPUUUIDs: []string{"  "}}, ReasonBadGPUUUID, "gpuUuids[0]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Normalize(tc.in)
			var ce *ClaimError
			if !errors.As(err, &ce) {
				t.Fatalf("Normalize: got %v, want *ClaimError %s", err, tc.reason)
			}
			if ce.Reason != tc.reason || ce.Field != tc.field {
				t.Errorf("got reason %q field %q, want %q %q", ce.Reason, ce.Field, tc.reason, tc.field)
			}
			if err := Validate(tc.in); err == nil || err.Error() != ce.Error() {
				t.Errorf("Validate: got %v, want %v", err, ce)
			}
		})
	}
}

func TestNormalizeLimitsInclusive(t *testing.T) {
	var macs, gpus []string
	for i := range MaxMACs {
		macs = append(macs, formatMAC([6]byte{0x3c, 0xec, 0xef, 0, 0, byte(i)}))
	}
	for i := range MaxGPUUUIDs {
		gpus = append(gpus, "GPU-"+strings.Repeat("b", i+1))
	}
	c := Claims{
		ProductSerial: strings.Repeat("s", MaxStringBytes),
		Hostname:      strings.Repeat("h", MaxHostnameBytes),
		MACs:          macs,
		GPUUUIDs:      gpus,
	}
	if err := Validate(c); err != nil {
		t.Fatalf("at the limits: %v", err)
	}
}

// The fold matches strings.EqualFold on every rune and is idempotent, which
// the key (case-folded serials) and GPU UUID matching rely on.
func TestFoldAllRunes(t *testing.T) {
	for r := rune(0); r <= utf8.MaxRune; r++ {
		f := foldRune(r)
		if foldRune(f) != f || !strings.EqualFold(string(r), string(f)) {
			t.Fatalf("%U folds to %U, which folds to %U", r, f, foldRune(f))
		}
	}
	if got := fold("GPU-ABC-ſ-K"); got != "gpu-abc-s-k" {
		t.Errorf("fold = %q", got)
	}
}
