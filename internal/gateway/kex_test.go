package gateway

import (
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"
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

// threadCPU is the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID,
// which cannot fail on Linux for the calling thread).
func threadCPU() time.Duration {
	var ts syscall.Timespec
	_, _, _ = syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 3, uintptr(unsafe.Pointer(&ts)), 0)
	return time.Duration(ts.Nano())
}

// BenchmarkServerHandshake measures the gateway's side of a daemon's TLS
// handshake alone (the server goroutine is locked to its thread, whose
// CPU time is read around the handshake and the first record, which
// carries the session ticket): full or resumed, with the hybrid default or
// X25519 alone; the daemon presents a node certificate. Reported as
// server-us/op.
func BenchmarkServerHandshake(b *testing.B) {
	e := newEnv(b)
	node := e.nodeCert(b, "node_1")
	for _, kex := range []string{KeyExchangeHybrid, KeyExchangeX25519} {
		for _, resume := range []bool{false, true} {
			name := kex + "/full"
			if resume {
				name = kex + "/resumed"
			}
			b.Run(name, func(b *testing.B) {
				cfg := e.config("https://127.0.0.1:1")
				cfg.TLSKeyExchange = kex
				g, err := New(cfg, Options{Log: quietLog()})
				if err != nil {
					b.Fatal(err)
				}
				cc := &tls.Config{RootCAs: e.roots, ServerName: "127.0.0.1", Certificates: []tls.Certificate{node}, NextProtos: []string{"h2"}}
				if resume {
					cc.ClientSessionCache = tls.NewLRUClientSessionCache(1)
				}
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					b.Fatal(err)
				}
				defer ln.Close()
				var spent time.Duration
				var resumed int
				for i := -1; i < b.N; i++ { // i == -1 leaves the first ticket
					d, ok := serverHandshake(b, ln, g.hs.TLSConfig, cc)
					if i >= 0 {
						spent += d
						if ok {
							resumed++
						}
					}
				}
				if resume != (resumed == b.N) {
					b.Fatalf("%d of %d handshakes resumed", resumed, b.N)
				}
				b.ReportMetric(float64(spent.Microseconds())/float64(b.N), "server-us/op")
			})
		}
	}
}

// serverHandshake runs one handshake over loopback TCP (a resuming server
// sends its ticket while the client writes its Finished: net.Pipe, which
// buffers nothing, would deadlock) and returns the server's CPU time for
// it and whether it resumed.
func serverHandshake(b *testing.B, ln net.Listener, sc, cc *tls.Config) (time.Duration, bool) {
	cs, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer cs.Close()
	ss, err := ln.Accept()
	if err != nil {
		b.Fatal(err)
	}
	type out struct {
		d       time.Duration
		resumed bool
		err     error
	}
	done := make(chan out, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer ss.Close()
		start := threadCPU()
		srv := tls.Server(ss, sc)
		err := srv.Handshake()
		if err == nil {
			_, err = srv.Write([]byte{1})
		}
		done <- out{threadCPU() - start, srv.ConnectionState().DidResume, err}
	}()
	c := tls.Client(cs, cc)
	if err := c.Handshake(); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		b.Fatal(err)
	}
	o := <-done
	if o.err != nil {
		b.Fatal(o.err)
	}
	return o.d, o.resumed
}
