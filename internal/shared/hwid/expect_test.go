package hwid

import (
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/google/go-cmp/cmp"
)

// R5.2: the binding is normalized at token creation.
func TestNormalizeExpect(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   Expect
		want Expect
	}{
		{"empty binds nothing", Expect{}, Expect{}},
		{"R5.2 productUuid lower case dashed", Expect{ProductUUID: "4C4C454400423510" + "8052B4C04F4E3732"}, Expect{ProductUUID: uuidA}},
		{"R5.2 serial trimmed, case kept", Expect{Serial: " Cz2345abcd "}, Expect{Serial: "Cz2345abcd"}},
		{"R5.2 mac separators and case", Expect{MAC: "3CEC.EF01.0203"}, Expect{MAC: macA}},
		{"R5.2 mac dashes", Expect{MAC: "3C-EC-EF-01-02-03"}, Expect{MAC: macA}},
		{"R5.2 gpuUuid lower case", Expect{GPUUUID: " GPU-8F0C "}, Expect{GPUUUID: "gpu-8f0c"}},
		{"all four", Expect{ProductUUID: uuidA, Serial: serialA, MAC: macA, GPUUUID: gpuA},
			Expect{ProductUUID: uuidA, Serial: serialA, MAC: macA, GPUUUID: strings.ToLower(gpuA)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NormalizeExpect(tc.in)
			if err != nil {
				t.Fatalf("NormalizeExpect: %v", err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			again, err := NormalizeExpect(got)
			if err != nil || again != got {
				t.Errorf("not idempotent: %+v, %v", again, err)
			}
		})
	}
}

// R5.2: a binding that could never match, or names a MAC that is not a
// physical NIC's, is refused with INVALID_ARGUMENT naming the field.
func TestNormalizeExpectRefuses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    Expect
		field string
	}{
		{"R5.2 productUuid not a uuid", Expect{ProductUUID: "node-1"}, FieldExpectProductUUID},
		{"R5.2 productUuid all zero", Expect{ProductUUID: "00000000-0000-0000-0000-000000000000"}, FieldExpectProductUUID},
		{"R5.2 productUuid all F", Expect{ProductUUID: "FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF"}, FieldExpectProductUUID},
		{"R5.2 productUuid Supermicro placeholder", Expect{ProductUUID: "03000200-0400-0500-0006-000700080009"}, FieldExpectProductUUID},
		{"R5.2 productUuid control char", Expect{ProductUUID: uuidA + "\x00"}, FieldExpectProductUUID},
		{"R5.2 serial blank", Expect{Serial: "   "}, FieldExpectSerial},
		{"R5.2 serial placeholder", Expect{Serial: "To Be Filled By O.E.M."}, FieldExpectSerial},
		{"R5.2 serial repeated char", Expect{Serial: "0000000"}, FieldExpectSerial},
		{"R5.2 serial not printable", Expect{Serial: "abc\n"}, FieldExpectSerial},
		{"R5.2 serial invalid utf-8", Expect{Serial: "abc\xff"}, FieldExpectSerial},
		{"R5.2 serial too long", Expect{Serial: strings.Repeat("a", MaxStringBytes+1)}, FieldExpectSerial},
		{"R5.2 mac malformed", Expect{MAC: "3c:ec:ef:01:02"}, FieldExpectMAC},
		{"R5.2 mac locally administered", Expect{MAC: "02:42:ac:11:00:02"}, FieldExpectMAC},
		{"R5.2 mac locally administered (0x06)", Expect{MAC: "06:00:00:00:00:01"}, FieldExpectMAC},
		{"R5.2 mac multicast", Expect{MAC: "01:00:5e:00:00:01"}, FieldExpectMAC},
		{"R5.2 mac broadcast", Expect{MAC: "ff:ff:ff:ff:ff:ff"}, FieldExpectMAC},
		{"R5.2 mac all zero", Expect{MAC: "00:00:00:00:00:00"}, FieldExpectMAC},
		{"R5.2 mac placeholder", Expect{MAC: "44:44:44:44:44:44"}, FieldExpectMAC},
		{"R5.2 gpuUuid blank", Expect{GPUUUID: " "}, FieldExpectGPUUUID},
		{"R5.2 gpuUuid not printable", Expect{GPUUUID: "GPU-\u202e1"}, FieldExpectGPUUUID},
		{"R5.2 gpuUuid placeholder", Expect{GPUUUID: "GPU-00000000-0000-0000-0000-000000000000"}, FieldExpectGPUUUID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NormalizeExpect(tc.in)
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != tc.field {
				t.Fatalf("got %v, want INVALID_ARGUMENT on %s", err, tc.field)
			}
		})
	}
}

// R5.1, R5.2: every named identifier must be among the claims.
func TestMatches(t *testing.T) {
	claims := Claims{
		ProductUUID:   "4C4C4544-0042-3510-8052-B4C04F4E3732",
		ProductSerial: "PS-ABC",
		BoardSerial:   "bs-def",
		ChassisSerial: " Cs-Ghi ",
		MACs:          []string{"3C-EC-EF-01-02-03", "02:42:ac:11:00:02"},
		GPUUUIDs:      []string{"GPU-8F0C1D2E"},
	}
	placeholderUUID := Claims{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "Default string", MACs: []string{macA}}
	for _, tc := range []struct {
		name   string
		claims Claims
		e      Expect
		want   string // mismatched field, "" for a match
	}{
		{"R5.1 empty binding matches any machine", claims, Expect{}, ""},
		{"R5.2 productUuid lower case dashed", claims, Expect{ProductUUID: uuidA}, ""},
		{"R5.2 productUuid undashed upper case", claims, Expect{ProductUUID: "4C4C4544004235108052B4C04F4E3732"}, ""},
		{"R5.2 productUuid braces", claims, Expect{ProductUUID: "{" + uuidA + "}"}, ""},
		{"R5.2 productUuid other", claims, Expect{ProductUUID: uuidB}, FieldExpectProductUUID},
		{"R5.2 placeholder productUuid never matches", placeholderUUID, Expect{ProductUUID: "03000200-0400-0500-0006-000700080009"}, FieldExpectProductUUID},
		{"R5.2 all-zero productUuid never matches", Claims{ProductUUID: "00000000-0000-0000-0000-000000000000"}, Expect{ProductUUID: "00000000000000000000000000000000"}, FieldExpectProductUUID},
		{"R5.2 serial matches product serial case-insensitively", claims, Expect{Serial: "ps-abc"}, ""},
		{"R5.2 serial matches board serial case-insensitively", claims, Expect{Serial: "BS-DEF"}, ""},
		{"R5.2 serial matches chassis serial case-insensitively", claims, Expect{Serial: "cS-gHI"}, ""},
		{"R5.2 serial other", claims, Expect{Serial: "PS-ABD"}, FieldExpectSerial},
		{"R5.2 placeholder serial never matches", placeholderUUID, Expect{Serial: "Default string"}, FieldExpectSerial},
		{"R5.2 mac colons lower case", claims, Expect{MAC: macA}, ""},
		{"R5.2 mac dots upper case", claims, Expect{MAC: "3CEC.EF01.0203"}, ""},
		{"R5.2 mac no separators", claims, Expect{MAC: "3cecef010203"}, ""},
		{"R5.2 mac other", claims, Expect{MAC: macB}, FieldExpectMAC},
		{"R5.2 locally administered mac never matches", claims, Expect{MAC: "02:42:ac:11:00:02"}, FieldExpectMAC},
		{"R5.2 gpuUuid case-insensitive", claims, Expect{GPUUUID: "gpu-8f0c1d2e"}, ""},
		{"R5.2 gpuUuid other", claims, Expect{GPUUUID: "GPU-8F0C1D2F"}, FieldExpectGPUUUID},
		{"R5.1 all named must match", claims, Expect{ProductUUID: uuidA, Serial: "bs-def", MAC: macA, GPUUUID: "GPU-8f0c1d2e"}, ""},
		{"R5.1 one mismatch refuses", claims, Expect{ProductUUID: uuidA, Serial: "bs-def", MAC: macB, GPUUUID: "GPU-8f0c1d2e"}, FieldExpectMAC},
		{"R5.1 nothing claimed", Claims{}, Expect{Serial: "PS-ABC"}, FieldExpectSerial},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := mustNormalize(t, tc.claims)
			if got := tc.e.Mismatch(n); got != tc.want {
				t.Errorf("Mismatch = %q, want %q", got, tc.want)
			}
			if got := tc.e.Matches(n); got != (tc.want == "") {
				t.Errorf("Matches = %v", got)
			}
		})
	}
}
