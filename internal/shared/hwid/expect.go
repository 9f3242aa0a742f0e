package hwid

import (
	"slices"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Expect field names, as named in INVALID_ARGUMENT errors and mismatches.
const (
	FieldExpectProductUUID = "expect.productUuid"
	FieldExpectSerial      = "expect.serial"
	FieldExpectMAC         = "expect.mac"
	FieldExpectGPUUUID     = "expect.gpuUuid"
)

// NormalizeExpect validates a token's expect binding at token creation and
// returns it normalized (R5.2): productUuid lower case and dashed; serial
// trimmed (case kept, it matches case-insensitively); mac lower case, colon
// separated; gpuUuid trimmed and lower-cased. Empty fields bind nothing and
// stay empty. It refuses, with an *errs.E INVALID_ARGUMENT naming the field:
// a productUuid that is not a UUID or is a placeholder (it could never
// match); a serial that is blank, not printable or a placeholder; a mac that
// is not 6 octets, or is multicast, locally administered, all zero or a
// placeholder (only permanent, globally administered MACs of physical NICs
// bind); a gpuUuid that is blank, not printable or a placeholder. Every
// string is at most MaxStringBytes.
func NormalizeExpect(e Expect) (Expect, error) {
	var out Expect
	if e.ProductUUID != "" {
		if !textOK(e.ProductUUID) {
			return Expect{}, errs.Invalid(FieldExpectProductUUID, "must be printable text of at most %d bytes", MaxStringBytes)
		}
		u, ok := parseUUID(strings.TrimSpace(e.ProductUUID))
		if !ok {
			return Expect{}, errs.Invalid(FieldExpectProductUUID, "must be a UUID")
		}
		if IsPlaceholderUUID(u) {
			return Expect{}, errs.Invalid(FieldExpectProductUUID, "is a placeholder UUID, which never matches")
		}
		out.ProductUUID = u
	}
	if e.Serial != "" {
		if !textOK(e.Serial) {
			return Expect{}, errs.Invalid(FieldExpectSerial, "must be printable text of at most %d bytes", MaxStringBytes)
		}
		s := strings.TrimSpace(e.Serial)
		if s == "" {
			return Expect{}, errs.Invalid(FieldExpectSerial, "must not be blank")
		}
		if IsPlaceholder(s) {
			return Expect{}, errs.Invalid(FieldExpectSerial, "is a placeholder serial, which never matches")
		}
		out.Serial = s
	}
	if e.MAC != "" {
		if !textOK(e.MAC) {
			return Expect{}, errs.Invalid(FieldExpectMAC, "must be printable text of at most %d bytes", MaxStringBytes)
		}
		m, ok := parseMAC(strings.TrimSpace(e.MAC))
		if !ok {
			return Expect{}, errs.Invalid(FieldExpectMAC, "must be a MAC address of 6 octets")
		}
		if !permanentMAC(m) {
			return Expect{}, errs.Invalid(FieldExpectMAC, "must be the permanent, globally administered unicast MAC of a physical NIC")
		}
		s := formatMAC(m)
		if IsPlaceholder(s) {
			return Expect{}, errs.Invalid(FieldExpectMAC, "is a placeholder MAC, which never matches")
		}
		out.MAC = s
	}
	if e.GPUUUID != "" {
		if !textOK(e.GPUUUID) {
			return Expect{}, errs.Invalid(FieldExpectGPUUUID, "must be printable text of at most %d bytes", MaxStringBytes)
		}
		g := fold(strings.TrimSpace(e.GPUUUID))
		if g == "" {
			return Expect{}, errs.Invalid(FieldExpectGPUUUID, "must not be blank")
		}
		if len(g) > MaxStringBytes {
			return Expect{}, errs.Invalid(FieldExpectGPUUUID, "must be printable text of at most %d bytes", MaxStringBytes)
		}
		if gpuPlaceholder(g) {
			return Expect{}, errs.Invalid(FieldExpectGPUUUID, "is a placeholder GPU UUID, which never matches")
		}
		out.GPUUUID = g
	}
	return out, nil
}

func textOK(s string) bool { return len(s) <= MaxStringBytes && printable(s) }

// Matches reports whether every identifier e names is among n's claims
// (R5.1, R5.2). An empty binding matches any machine. e is normalized first
// (a binding NormalizeExpect would refuse matches nothing), so callers may
// pass a stored binding as is.
func (e Expect) Matches(n Normalized) bool {
	return e.Mismatch(n) == ""
}

// Mismatch returns the first field of e (FieldExpect...) whose identifier
// is not among n's claims, or "" when e matches n. It is Matches with the
// reason, for refusals and audit.
//
//   - productUuid equals the claimed product UUID, both lower case and
//     dashed; a placeholder UUID never matches.
//   - serial equals the product, board or chassis serial, case-insensitively
//     and trimmed; a placeholder never matches.
//   - mac is among the claimed permanent MACs (separators and case do not
//     matter; locally administered and multicast MACs were dropped from the
//     claims and are refused in a binding).
//   - gpuUuid is among the claimed GPU UUIDs, case-insensitively.
func (e Expect) Mismatch(n Normalized) string {
	if e.Empty() {
		return ""
	}
	ne, err := NormalizeExpect(e)
	if err != nil {
		if x, ok := errs.As(err); ok && x.Field != "" {
			return x.Field
		}
		return FieldExpectProductUUID // unreachable: NormalizeExpect names the field
	}
	if ne.ProductUUID != "" && ne.ProductUUID != n.c.ProductUUID {
		return FieldExpectProductUUID
	}
	if ne.Serial != "" {
		f := fold(ne.Serial)
		if f != fold(n.c.ProductSerial) && f != fold(n.c.BoardSerial) && f != fold(n.c.ChassisSerial) {
			return FieldExpectSerial
		}
	}
	if ne.MAC != "" {
		if _, ok := slices.BinarySearch(n.c.MACs, ne.MAC); !ok {
			return FieldExpectMAC
		}
	}
	if ne.GPUUUID != "" {
		if _, ok := slices.BinarySearch(n.c.GPUUUIDs, ne.GPUUUID); !ok {
			return FieldExpectGPUUUID
		}
	}
	return ""
}
