package hwid

import (
	"strings"
	"unicode"
)

// placeholderWord reports whether k, a value folded with everything but
// letters and digits removed, is one firmware reports instead of a real
// identifier; so "To Be Filled By O.E.M.", "to be filled by OEM" and
// "TO_BE_FILLED_BY_O.E.M" are one entry. (A switch rather than a map: the
// package holds no mutable state.)
func placeholderWord(k string) bool {
	switch k {
	case "tobefilledbyoem",
		"defaultstring",
		"default",
		"systemserialnumber",
		"chassisserialnumber",
		"baseboardserialnumber",
		"serialnumber",
		"systemproductname",
		"systemversion",
		"type1productconfigid",
		"notspecified",
		"notapplicable",
		"notavailable",
		"notpresent",
		"notsettable",
		"none",
		"null",
		"na", // N/A
		"oem",
		"invalid",
		"empty",
		"unknown",
		"0123456789",
		"123456789",
		"1234567890":
		return true
	}
	return false
}

// placeholderUUID reports whether u, lower case and dashed, is a product
// UUID shared by many boards. All-zero and all-F UUIDs are caught by the
// repeated-character rule.
func placeholderUUID(u string) bool {
	switch u {
	case
		// The Supermicro/AMI "unset" UUID, as Linux reports it (SMBIOS
		// stores the first three fields little-endian)...
		"03000200-0400-0500-0006-000700080009",
		// ...and as read big-endian.
		"00020003-0004-0005-0006-000700080009":
		return true
	}
	return false
}

// IsPlaceholder reports whether s is a value firmware reports instead of a
// real identifier: empty or blank; one of the well-known placeholder
// strings ("To Be Filled By O.E.M.", "Default string", "System Serial
// Number", "Not Specified", "N/A", "None", "0", "0123456789", ...), compared
// case-insensitively and ignoring punctuation and spaces; a value made of
// one repeated character once separators (space, '-', ':', '.', '_', '/')
// are ignored, case-insensitively ("0000-0000", "FFFFFFFF", "xXxX"); or a
// placeholder UUID (see IsPlaceholderUUID). Placeholders are dropped before
// the hardware key is derived, never match an expect binding and are
// refused in one.
func IsPlaceholder(s string) bool {
	s = strings.TrimSpace(s)
	if repeated(s) {
		return true
	}
	var b strings.Builder
	for _, r := range s {
		if unicode.IsLetter(r) || unicode.IsDigit(r) {
			b.WriteRune(foldRune(r))
		}
	}
	if placeholderWord(b.String()) {
		return true
	}
	if u, ok := parseUUID(s); ok && placeholderUUID(u) {
		return true
	}
	return false
}

// IsPlaceholderUUID reports whether u, a product UUID in any accepted form
// (dashed or not, any case, optionally in braces), is a placeholder: all
// zero, all F, one repeated digit, a well-known shared value such as
// 03000200-0400-0500-0006-000700080009, or a placeholder string where a UUID
// should be. A placeholder UUID never matches an expect binding and does not
// count towards the hardware key. A string that is neither a UUID nor a
// placeholder is not a placeholder, merely invalid.
func IsPlaceholderUUID(u string) bool {
	if n, ok := parseUUID(strings.TrimSpace(u)); ok {
		return IsPlaceholder(n)
	}
	return IsPlaceholder(u)
}

func isSeparator(r rune) bool {
	switch r {
	case '-', ':', '.', '_', '/':
		return true
	}
	return unicode.IsSpace(r)
}

// repeated reports whether s, separators ignored, is empty or one rune
// repeated (case-insensitively).
func repeated(s string) bool {
	var first rune = -1
	for _, r := range s {
		if isSeparator(r) {
			continue
		}
		r = foldRune(r)
		if first == -1 {
			first = r
		} else if r != first {
			return false
		}
	}
	return true
}
