package h2upstream

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"sync"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
)

// goAwayPeer is a server written on the Framer: it answers each stream's
// HEADERS with :status 200 and, at a connection's second stream, sends
// GOAWAY naming the first as the last it takes, then one message and
// trailers on the first (unless hold: the first stays open).
func goAwayPeer(t *testing.T, hold bool) (addr string, cfg *tls.Config) {
	srv := grpcPeer(t, 100) // for its certificate
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: srv.TLS.Certificates, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { serveGoAway(c, hold) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), peerTLS(srv)
}

func serveGoAway(c net.Conn, hold bool) {
	defer c.Close()
	if _, err := io.ReadFull(c, make([]byte, len(http2.ClientPreface))); err != nil {
		return
	}
	fr := http2.NewFramer(c, c)
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	headers := func(id uint32, end bool, fields ...string) error {
		hbuf.Reset()
		for i := 0; i < len(fields); i += 2 {
			_ = enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
		}
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true, EndStream: end})
	}
	if fr.WriteSettings() != nil {
		return
	}
	var ids []uint32
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		h, ok := f.(*http2.HeadersFrame)
		if !ok {
			continue
		}
		ids = append(ids, h.StreamID)
		if headers(h.StreamID, false, ":status", "200", "content-type", "application/grpc") != nil {
			return
		}
		if len(ids) == 2 {
			_ = fr.WriteGoAway(ids[0], http2.ErrCodeNo, nil)
			_ = fr.WriteData(ids[0], false, frameMessage([]byte("last")))
			if !hold {
				_ = headers(ids[0], true, "grpc-status", "0")
			}
		}
	}
}

// Streams past GOAWAY's last stream fail with a retryable error; the one
// before it ends normally; new streams go to another connection.
func TestGoAwayMidStream(t *testing.T) {
	addr, tc := goAwayPeer(t, false)
	cl := newClient(t, Config{Addr: addr, TLS: tc, Conns: 1})
	first, second := newRecorder(), newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/x"}, first); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Open(bg, Request{Path: "/x"}, second); err != nil {
		t.Fatal(err)
	}
	if _, err := second.end(t); !IsRetryable(err) {
		t.Fatalf("the stream past GOAWAY ended with %v, want a retryable error", err)
	}
	if st, err := first.end(t); err != nil || st.Code != 0 || len(first.msgs) != 1 || string(first.msgs[0]) != "last" {
		t.Fatalf("the stream before GOAWAY: %v %v %q", st, err, first.msgs)
	}
	again := newRecorder()
	s, err := cl.Open(bg, Request{Path: "/x"}, again)
	if err != nil {
		t.Fatal(err)
	}
	if s.ID() != 1 {
		t.Errorf("the retried stream is %d: not on a new connection", s.ID())
	}
}

// A connection going away with a stream still open stays until Close,
// which ends the stream and joins the connection's goroutine.
func TestCloseWhileGoingAway(t *testing.T) {
	addr, tc := goAwayPeer(t, true)
	before := goroutines.Take()
	cl, err := New(Config{Addr: addr, TLS: tc, Conns: 1, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	first, second := newRecorder(), newRecorder()
	first.got = make(chan []byte, 1)
	if _, err := cl.Open(bg, Request{Path: "/x"}, first); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Open(bg, Request{Path: "/x"}, second); err != nil {
		t.Fatal(err)
	}
	<-first.got
	if _, err := second.end(t); !IsRetryable(err) {
		t.Fatalf("the stream past GOAWAY ended with %v", err)
	}
	if cl.Conns() != 0 {
		t.Errorf("a connection going away is offered for new streams")
	}
	cl.Close()
	if _, err := first.end(t); !isErr(err, ErrClosed) {
		t.Fatalf("the open stream ended with %v, want ErrClosed", err)
	}
	goroutines.Joined(t, before, "internal/gateway/h2upstream")
}
