package bcdconfig

import "testing"

func TestListenLoopbackOnly(t *testing.T) {
	for _, c := range []struct {
		cfg Diagnostics
		ok  bool
	}{
		{Diagnostics{}, true},
		{Diagnostics{Listen: DefaultDiagnosticsListen}, true},
		{Diagnostics{Listen: "[::1]:9464"}, true},
		{Diagnostics{Listen: "localhost:9464"}, true},
		{Diagnostics{Listen: ":9464"}, false},
		{Diagnostics{Listen: "0.0.0.0:9464"}, false},
		{Diagnostics{Listen: "10.0.0.5:9464"}, false},
		{Diagnostics{Listen: "10.0.0.5:9464", AllowNonLoopback: true}, true},
		{Diagnostics{Listen: "no-port"}, false},
	} {
		if got := c.cfg.Problem() == ""; got != c.ok {
			t.Errorf("%+v: accepted %v, want %v (%s)", c.cfg, got, c.ok, c.cfg.Problem())
		}
	}
}
