package hwid

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Limits on claims. Anything beyond them is odd input and refuses the join.
const (
	// MaxStringBytes bounds every claim string but the hostname, in bytes
	// before trimming.
	MaxStringBytes = 128
	// MaxHostnameBytes bounds the hostname, in bytes before trimming.
	MaxHostnameBytes = 253
	// MaxMACs bounds the number of MACs a machine may claim.
	MaxMACs = 64
	// MaxGPUUUIDs bounds the number of GPU UUIDs a machine may claim.
	MaxGPUUUIDs = 64
)

// Machine reasons carried by *ClaimError. JoinService records the reason and
// refuses the join.
const (
	ReasonInvalidUTF8  = "claims-invalid-utf8"       // a string is not valid UTF-8
	ReasonControlChar  = "claims-control-char"       // a control, format, private-use or line/paragraph separator character
	ReasonTooLong      = "claims-too-long"           // a string exceeds MaxStringBytes (MaxHostnameBytes for the hostname)
	ReasonTooMany      = "claims-too-many"           // more than MaxMACs MACs or MaxGPUUUIDs GPU UUIDs
	ReasonDuplicateMAC = "claims-duplicate-mac"      // two MACs equal after normalization
	ReasonDuplicateGPU = "claims-duplicate-gpu-uuid" // two GPU UUIDs equal case-insensitively
	ReasonBadMAC       = "claims-bad-mac"            // a MAC that is not 6 octets in an accepted layout
	ReasonBadUUID      = "claims-bad-uuid"           // a product UUID that is not a UUID
	ReasonBadGPUUUID   = "claims-bad-gpu-uuid"       // an empty (or blank) GPU UUID
)

// ClaimError refuses claims. Reason is one of the Reason constants, short
// and stable, for events and audit; Field names the offending claim by its
// JSON name (e.g. "macs[3]").
type ClaimError struct {
	Reason string
	Field  string
}

// Error returns "hwid: <reason>: <field>".
func (e *ClaimError) Error() string {
	if e.Field == "" {
		return "hwid: " + e.Reason
	}
	return "hwid: " + e.Reason + ": " + e.Field
}

// Normalized are claims that passed validation, in canonical form:
//
//   - productUuid lower case and dashed (placeholders are kept here, for the
//     record, and dropped by Key and Matches);
//   - serials trimmed of surrounding white space, original case kept for
//     display (they compare case-insensitively);
//   - MACs lower case, colon separated, only permanent globally administered
//     unicast ones (others are dropped, not refused), sorted;
//   - GPU UUIDs trimmed and lower-cased (case-folded), sorted;
//   - hostname trimmed (display only, never an identifier).
//
// Only Normalize makes one, so a Normalized is always valid; the zero value
// is valid empty claims. It holds no identifiers that the key and matching
// have to re-check for format.
type Normalized struct {
	c Claims
}

// Claims returns the normalized claims, e.g. to record them. Normalize of
// the result returns an equal Normalized.
func (n Normalized) Claims() Claims {
	c := n.c
	c.MACs = slices.Clone(c.MACs)
	c.GPUUUIDs = slices.Clone(c.GPUUUIDs)
	return c
}

// ProductUUID returns the lower case dashed product UUID, or "".
func (n Normalized) ProductUUID() string { return n.c.ProductUUID }

// MACs returns the permanent MACs, lower case and colon separated, sorted.
func (n Normalized) MACs() []string { return slices.Clone(n.c.MACs) }

// GPUUUIDs returns the GPU UUIDs, lower-cased, sorted.
func (n Normalized) GPUUUIDs() []string { return slices.Clone(n.c.GPUUUIDs) }

// Equal reports whether n and m are the same normalized claims.
func (n Normalized) Equal(m Normalized) bool {
	return n.c.ProductUUID == m.c.ProductUUID &&
		n.c.ProductSerial == m.c.ProductSerial &&
		n.c.BoardSerial == m.c.BoardSerial &&
		n.c.ChassisSerial == m.c.ChassisSerial &&
		n.c.Hostname == m.c.Hostname &&
		slices.Equal(n.c.MACs, m.c.MACs) &&
		slices.Equal(n.c.GPUUUIDs, m.c.GPUUUIDs)
}

// Validate reports whether c is acceptable claims; the error is a
// *ClaimError. It is Normalize without the result.
func Validate(c Claims) error {
	_, err := Normalize(c)
	return err
}

// Normalize validates c and returns it in canonical form (see Normalized).
// Odd input is refused with a *ClaimError: strings that are not UTF-8, that
// hold control or format characters, or that are too long; too many MACs or
// GPU UUIDs; malformed MACs or product UUID; duplicate MACs or GPU UUIDs
// after normalization. A well-formed MAC that is multicast, locally
// administered or all zero is not a permanent NIC MAC: it is dropped, not
// refused (bcd does not send them, but a VM may). Empty fields are absent.
func Normalize(c Claims) (Normalized, error) {
	if len(c.MACs) > MaxMACs {
		return Normalized{}, &ClaimError{Reason: ReasonTooMany, Field: "macs"}
	}
	if len(c.GPUUUIDs) > MaxGPUUUIDs {
		return Normalized{}, &ClaimError{Reason: ReasonTooMany, Field: "gpuUuids"}
	}
	var n Claims
	var err error

	if err = checkText("productUuid", c.ProductUUID, MaxStringBytes); err != nil {
		return Normalized{}, err
	}
	if s := strings.TrimSpace(c.ProductUUID); s != "" {
		u, ok := parseUUID(s)
		if !ok {
			return Normalized{}, &ClaimError{Reason: ReasonBadUUID, Field: "productUuid"}
		}
		n.ProductUUID = u
	}

	for _, f := range []struct {
		name string
		in   string
		out  *string
	}{
		{"productSerial", c.ProductSerial, &n.ProductSerial},
		{"boardSerial", c.BoardSerial, &n.BoardSerial},
		{"chassisSerial", c.ChassisSerial, &n.ChassisSerial},
	} {
		if err = checkText(f.name, f.in, MaxStringBytes); err != nil {
			return Normalized{}, err
		}
		*f.out = strings.TrimSpace(f.in)
	}

	if err = checkText("hostname", c.Hostname, MaxHostnameBytes); err != nil {
		return Normalized{}, err
	}
	n.Hostname = strings.TrimSpace(c.Hostname)

	// Duplicates are checked among every well-formed MAC, permanent or not:
	// the same MAC twice is odd input either way.
	seen := make(map[[6]byte]bool, len(c.MACs))
	for i, s := range c.MACs {
		field := indexed("macs", i)
		if err = checkText(field, s, MaxStringBytes); err != nil {
			return Normalized{}, err
		}
		m, ok := parseMAC(strings.TrimSpace(s))
		if !ok {
			return Normalized{}, &ClaimError{Reason: ReasonBadMAC, Field: field}
		}
		if seen[m] {
			return Normalized{}, &ClaimError{Reason: ReasonDuplicateMAC, Field: field}
		}
		seen[m] = true
		if permanentMAC(m) {
			n.MACs = append(n.MACs, formatMAC(m))
		}
	}
	slices.Sort(n.MACs)

	gseen := make(map[string]bool, len(c.GPUUUIDs))
	for i, s := range c.GPUUUIDs {
		field := indexed("gpuUuids", i)
		if err = checkText(field, s, MaxStringBytes); err != nil {
			return Normalized{}, err
		}
		g := fold(strings.TrimSpace(s))
		if g == "" {
			return Normalized{}, &ClaimError{Reason: ReasonBadGPUUUID, Field: field}
		}
		if len(g) > MaxStringBytes {
			// Lower-casing can lengthen some runes (U+023A to U+2C65).
			return Normalized{}, &ClaimError{Reason: ReasonTooLong, Field: field}
		}
		if gseen[g] {
			return Normalized{}, &ClaimError{Reason: ReasonDuplicateGPU, Field: field}
		}
		gseen[g] = true
		n.GPUUUIDs = append(n.GPUUUIDs, g)
	}
	slices.Sort(n.GPUUUIDs)

	return Normalized{c: n}, nil
}

func indexed(name string, i int) string {
	return name + "[" + strconv.Itoa(i) + "]"
}

// checkText refuses s when longer than max bytes, not UTF-8, or holding a
// character that has no business in a hardware identifier or a display
// string.
func checkText(field, s string, max int) error {
	if len(s) > max {
		return &ClaimError{Reason: ReasonTooLong, Field: field}
	}
	if !utf8.ValidString(s) {
		return &ClaimError{Reason: ReasonInvalidUTF8, Field: field}
	}
	for _, r := range s {
		if badRune(r) {
			return &ClaimError{Reason: ReasonControlChar, Field: field}
		}
	}
	return nil
}

// badRune reports control (Cc), format (Cf: bidi overrides, zero-width
// characters), private-use (Co) and surrogate (Cs) characters, and the line
// and paragraph separators (Zl, Zp).
func badRune(r rune) bool {
	return unicode.In(r, unicode.Cc, unicode.Cf, unicode.Co, unicode.Cs, unicode.Zl, unicode.Zp)
}

// printable reports whether s is valid UTF-8 without a bad rune.
func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if badRune(r) {
			return false
		}
	}
	return true
}

// fold returns the case-folded form of s: two strings are equal under
// strings.EqualFold exactly when their folds are equal. Each rune maps to
// one rune of its simple case-folding orbit, the lower case one where there
// is one, so ASCII folds to lower case.
func fold(s string) string {
	ascii := true
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			ascii = false
			break
		}
	}
	if ascii {
		return strings.ToLower(s)
	}
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		b.WriteRune(foldRune(r))
	}
	return b.String()
}

func foldRune(r rune) rune {
	m := foldMin(r)
	// Prefer the lower case, when it is in the orbit: U+0130 (İ) lowers to
	// 'i' but does not fold to it.
	if l := unicode.ToLower(m); l != m && foldMin(l) == m {
		return l
	}
	return m
}

// foldMin returns the smallest rune of r's simple case-folding orbit.
func foldMin(r rune) rune {
	m := r
	for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
		if f < m {
			m = f
		}
	}
	return m
}

// parseUUID accepts a UUID dashed (8-4-4-4-12) or as 32 hex digits, in any
// case, optionally in braces, and returns it lower case and dashed.
func parseUUID(s string) (string, bool) {
	if len(s) >= 2 && s[0] == '{' && s[len(s)-1] == '}' {
		s = s[1 : len(s)-1]
	}
	var hex []byte
	switch len(s) {
	case 36:
		if s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
			return "", false
		}
		hex = make([]byte, 0, 32)
		for i := 0; i < len(s); i++ {
			if i == 8 || i == 13 || i == 18 || i == 23 {
				continue
			}
			hex = append(hex, s[i])
		}
	case 32:
		hex = []byte(s)
	default:
		return "", false
	}
	for i, c := range hex {
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f':
		case c >= 'A' && c <= 'F':
			hex[i] = c + ('a' - 'A')
		default:
			return "", false
		}
	}
	h := string(hex)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32], true
}

// parseMAC accepts 6 octets as aa:bb:cc:dd:ee:ff, aa-bb-cc-dd-ee-ff,
// aabb.ccdd.eeff or aabbccddeeff, in any case.
func parseMAC(s string) ([6]byte, bool) {
	var m [6]byte
	var hex string
	switch len(s) {
	case 12:
		hex = s
	case 17:
		sep := s[2]
		if sep != ':' && sep != '-' {
			return m, false
		}
		var b strings.Builder
		for i := 0; i < 17; i++ {
			if i%3 == 2 {
				if s[i] != sep {
					return m, false
				}
				continue
			}
			b.WriteByte(s[i])
		}
		hex = b.String()
	case 14:
		if s[4] != '.' || s[9] != '.' {
			return m, false
		}
		hex = s[0:4] + s[5:9] + s[10:14]
	default:
		return m, false
	}
	for i := range 6 {
		hi, ok1 := unhex(hex[2*i])
		lo, ok2 := unhex(hex[2*i+1])
		if !ok1 || !ok2 {
			return m, false
		}
		m[i] = hi<<4 | lo
	}
	return m, true
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

func formatMAC(m [6]byte) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 0, 17)
	for i, o := range m {
		if i > 0 {
			b = append(b, ':')
		}
		b = append(b, digits[o>>4], digits[o&0xf])
	}
	return string(b)
}

// permanentMAC reports whether m can be the burned-in MAC of a physical NIC:
// unicast (bit 0x01 of the first octet clear), globally administered (bit
// 0x02 clear) and not all zero.
func permanentMAC(m [6]byte) bool {
	return m[0]&0x03 == 0 && m != [6]byte{}
}

// NormalizeMAC returns a MAC in the claims' canonical form (lower case,
// colon-separated), and false when s is not a MAC a physical NIC can burn
// in (R10.4: a site agent's vouch and a ramdisk's evidence name the NIC it
// booted from).
func NormalizeMAC(s string) (string, bool) {
	m, ok := parseMAC(s)
	if !ok || !permanentMAC(m) {
		return "", false
	}
	return formatMAC(m), true
}

// Boot is a machine's network boot as a site agent vouches for it and its
// ramdisk presents it (R10.4): the NIC it booted from, the address and the
// epoch of its boot lease, and the site's provisioning workflow when one is
// named.
type Boot struct {
	MAC        string `json:"mac"`
	IP         string `json:"ip"`
	LeaseEpoch int64  `json:"leaseEpoch"`
	WorkflowID string `json:"workflowId,omitempty"`
}

// MaxWorkflowID bounds a boot's workflow id, in bytes.
const MaxWorkflowID = 128

// Check returns b in canonical form (the MAC as NormalizeMAC gives it, the
// address as netip prints it), or an INVALID_ARGUMENT naming the field.
// It is the one check of a boot, on bcd's side and the control plane's.
func (b Boot) Check() (Boot, error) {
	mac, ok := NormalizeMAC(b.MAC)
	if !ok {
		return b, errs.Invalid("mac", "want the permanent MAC of the NIC the machine booted from, like 00:1b:21:0a:0b:0c")
	}
	ip, err := netip.ParseAddr(b.IP)
	if err != nil {
		return b, errs.Invalid("ip", "want the IP address the boot lease gave, like 10.0.0.7")
	}
	if b.LeaseEpoch <= 0 {
		return b, errs.Invalid("leaseEpoch", "want the boot lease's epoch, a positive number")
	}
	if len(b.WorkflowID) > MaxWorkflowID || !printable(b.WorkflowID) {
		return b, errs.Invalid("workflowId", "at most %d printable bytes", MaxWorkflowID)
	}
	b.MAC, b.IP = mac, ip.String()
	return b, nil
}
