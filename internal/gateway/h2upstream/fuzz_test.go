package h2upstream

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// fuzzConn reads a hostile server's bytes and discards what is written.
type fuzzConn struct {
	r *bytes.Reader
	net.Conn
}

func (c *fuzzConn) Read(b []byte) (int, error)       { return c.r.Read(b) }
func (c *fuzzConn) Write(b []byte) (int, error)      { return len(b), nil }
func (c *fuzzConn) Close() error                     { return nil }
func (c *fuzzConn) SetDeadline(time.Time) error      { return nil }
func (c *fuzzConn) SetWriteDeadline(time.Time) error { return nil }
func (c *fuzzConn) SetReadDeadline(time.Time) error  { return nil }
func (c *fuzzConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *fuzzConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }

var _ io.ReadWriteCloser = (*fuzzConn)(nil)

// frames writes a server's frames with a Framer; hdr HPACK-encodes
// name, value pairs.
func frames(f func(fr *http2.Framer, hdr func(kv ...string) []byte)) []byte {
	var out, hb bytes.Buffer
	fr := http2.NewFramer(&out, nil)
	enc := hpack.NewEncoder(&hb)
	f(fr, func(kv ...string) []byte {
		hb.Reset()
		for i := 0; i+1 < len(kv); i += 2 {
			_ = enc.WriteField(hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
		}
		return bytes.Clone(hb.Bytes())
	})
	return out.Bytes()
}

func hp(id uint32, end bool, block []byte) http2.HeadersFrameParam {
	return http2.HeadersFrameParam{StreamID: id, BlockFragment: block, EndHeaders: true, EndStream: end}
}

// seeds are well-formed exchanges and hostile ones.
func seeds() [][]byte {
	ok := frames(func(fr *http2.Framer, hdr func(kv ...string) []byte) {
		_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
		_ = fr.WriteSettingsAck()
		_ = fr.WriteHeaders(hp(1, false, hdr(":status", "200", "content-type", "application/grpc")))
		_ = fr.WriteData(1, false, frameMessage([]byte("hello")))
		_ = fr.WriteHeaders(hp(1, true, hdr("grpc-status", "0")))
		_ = fr.WritePing(false, [8]byte{1})
		_ = fr.WritePing(true, [8]byte{'h', '2', 'u', 'p'})
		_ = fr.WriteWindowUpdate(0, 1000)
		_ = fr.WriteWindowUpdate(3, 1000)
		_ = fr.WriteHeaders(hp(3, true, hdr(":status", "200", "grpc-status", "5", "grpc-message", "gone%21")))
		_ = fr.WriteRSTStream(5, http2.ErrCodeRefusedStream)
		_ = fr.WriteGoAway(1, http2.ErrCodeNo, nil)
	})
	hostile := [][]byte{
		frames(func(fr *http2.Framer, hdr func(kv ...string) []byte) { // over the window, over the max size
			_ = fr.WriteHeaders(hp(1, false, hdr(":status", "200")))
			_ = fr.WriteData(1, false, []byte{0, 0x7f, 0xff, 0xff, 0xff})
			_ = fr.WriteHeaders(hp(3, false, hdr(":status", "200")))
			for range 5 {
				_ = fr.WriteData(3, false, make([]byte, 16<<10))
			}
		}),
		frames(func(fr *http2.Framer, hdr func(kv ...string) []byte) { // a CONTINUATION flood
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr(":status", "200")})
			big := hdr("x-big", string(bytes.Repeat([]byte("a"), 8000)))
			for range 10 {
				_ = fr.WriteContinuation(1, false, big)
			}
		}),
		frames(func(fr *http2.Framer, hdr func(kv ...string) []byte) { // protocol errors
			_ = fr.WriteData(1, false, []byte("before headers"))
			_ = fr.WriteHeaders(hp(3, false, hdr(":status", "abc")))
			_ = fr.WriteHeaders(hp(5, false, hdr(":status", "200")))
			_ = fr.WriteHeaders(hp(5, false, hdr("grpc-status", "0")))
			_ = fr.WriteWindowUpdate(0, 1<<31-1)
			_ = fr.WriteData(2, false, []byte("even"))
			_ = fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: hdr(":path", "/"), EndHeaders: true})
		}),
		frames(func(fr *http2.Framer, hdr func(kv ...string) []byte) {
			_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 31})
			_ = fr.WriteHeaders(hp(99, false, hdr(":status", "200")))
		}),
	}
	return append([][]byte{ok}, hostile...)
}

// A hostile server's frames: no panic, every stream ends, and no message
// over MaxMessageSize reaches a handler. Runs over the seeds in go test.
func FuzzReadFrames(f *testing.F) {
	for _, s := range seeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		const max = 1024
		cl, err := New(Config{Addr: "upstream:443", Clock: clock.NewFake(time.Unix(1e9, 0)), Log: quiet(),
			MaxMessageSize: max, InitialWindowSize: 32 << 10, MaxQueuedBytes: 64 << 10})
		if err != nil {
			t.Fatal(err)
		}
		c := newConn(cl, &fuzzConn{r: bytes.NewReader(data)})
		var recs []*recorder
		for i := range 3 {
			r := newRecorder()
			s := c.open(Request{Path: "/p"}, r)
			if s == nil {
				t.Fatal("open refused")
			}
			_ = s.Send(make([]byte, 100<<10*i))
			if i == 1 {
				_ = s.CloseSend()
			}
			recs = append(recs, r)
		}
		cl.wg.Add(1)
		c.run()
		cl.Close()
		for i, r := range recs {
			if !r.ended() {
				t.Fatalf("stream %d did not end", i)
			}
			for _, m := range r.msgs {
				if len(m) > max {
					t.Fatalf("a %d-byte message passed", len(m))
				}
			}
		}
	})
}
