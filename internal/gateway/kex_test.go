package gateway

import (
	"crypto/tls"
	"testing"
)

// The daemons' key exchange is the post-quantum hybrid unless the operator
// chose classical X25519 (tls_key_exchange); a client offering both gets
// what the gateway prefers.
func TestTLSKeyExchange(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		kex  string
		want tls.CurveID
	}{
		{"", tls.X25519MLKEM768},
		{KeyExchangeHybrid, tls.X25519MLKEM768},
		{KeyExchangeX25519, tls.X25519},
	} {
		t.Run(tc.kex, func(t *testing.T) {
			cfg := e.config("https://" + droppingListener(t))
			cfg.TLSKeyExchange = tc.kex
			_, addr := startGateway(t, cfg)
			conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: e.roots, ServerName: "127.0.0.1",
				CurvePreferences: []tls.CurveID{tls.X25519MLKEM768, tls.X25519}})
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if got := conn.ConnectionState().CurveID; got != tc.want {
				t.Errorf("key exchange %v, want %v", got, tc.want)
			}
		})
	}
}

