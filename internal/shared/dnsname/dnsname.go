// Package dnsname checks host names (for certificates, gateway server names
// and install scripts) in one place.
package dnsname

import "strings"

// Valid accepts host names of letters, digits and '-' in dot-separated
// labels of 1 to 63 characters, at most 253 in all, no label starting or
// ending with '-'.
func Valid(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}
