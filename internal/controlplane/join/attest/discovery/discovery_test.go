package discovery

import "testing"

// R10.4: the address the gateway saw must be the vouched IP, in whatever
// form the gateway's listener reports it.
func TestPeerReason(t *testing.T) {
	for _, tc := range []struct {
		peer, vouched, want string
	}{
		{"10.0.0.7:40000", "10.0.0.7", ""},
		{"10.0.0.7", "10.0.0.7", ""},
		{"[::ffff:10.0.0.7]:40000", "10.0.0.7", ""},
		{"[fe80::1%eth0]:40000", "fe80::1", ""},
		{"[2001:db8::7]:1", "2001:db8::7", ""},
		{"10.0.0.8:40000", "10.0.0.7", "vouch-peer"},
		{"127.0.0.1:40000", "10.0.0.7", "vouch-peer"},
		{"", "10.0.0.7", "vouch-peer"},
		{"not an address", "10.0.0.7", "vouch-peer"},
		{"10.0.0.7:40000", "", "vouch-peer"},
	} {
		if got := peerReason(tc.peer, tc.vouched); got != tc.want {
			t.Errorf("peerReason(%q, %q) = %q, want %q", tc.peer, tc.vouched, got, tc.want)
		}
	}
}
