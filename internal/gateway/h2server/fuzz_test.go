package h2server

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// seedFrames are frame sequences to start the fuzzer from (and the
// seeds in testdata/fuzz/FuzzFrames, which go test runs every time).
func seedFrames() [][]byte {
	var out [][]byte
	build := func(f func(fr *http2.Framer, hdr func(path string, extra ...string) []byte)) {
		var buf bytes.Buffer
		fr := http2.NewFramer(&buf, nil)
		fr.AllowIllegalWrites = true
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		hdr := func(path string, extra ...string) []byte {
			hb.Reset()
			kv := append([]string{":method", "POST", ":scheme", "https", ":authority", "x", ":path", path}, extra...)
			for i := 0; i < len(kv); i += 2 {
				_ = enc.WriteField(hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
			}
			return bytes.Clone(hb.Bytes())
		}
		f(fr, hdr)
		out = append(out, buf.Bytes())
	}
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr("/echo"), EndStream: true, EndHeaders: true})
	})
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr("/echo", "content-length", "5"), EndHeaders: true})
		_ = fr.WriteData(1, true, []byte("hello"))
		_ = fr.WriteWindowUpdate(0, 1000)
		_ = fr.WritePing(false, [8]byte{1})
	})
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		b := hdr("/echo", "x-a", strings.Repeat("a", 100))
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: b[:10]})
		_ = fr.WriteContinuation(3, false, b[10:20])
		_ = fr.WriteContinuation(3, true, b[20:])
		_ = fr.WriteRSTStream(3, http2.ErrCodeCancel)
	})
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr("/big?n=100000"), EndStream: true, EndHeaders: true})
		_ = fr.WriteWindowUpdate(1, 40000)
		_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	})
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr("/hold", "content-type", "application/grpc"), EndHeaders: true})
		_ = fr.WriteData(1, false, AppendMessage(nil, 0, []byte("heartbeat")))
		_ = fr.WriteDataPadded(1, false, []byte("x"), make([]byte, 20))
		_ = fr.WritePriority(1, http2.PriorityParam{StreamDep: 1})
		_ = fr.WriteData(1, true, nil)
		_ = fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	})
	build(func(fr *http2.Framer, hdr func(string, ...string) []byte) {
		for i := uint32(1); i < 40; i += 2 {
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: i, BlockFragment: hdr("/hold"), EndHeaders: true})
			_ = fr.WriteRSTStream(i, http2.ErrCodeCancel)
		}
	})
	return out
}

// fuzzHandler serves /hold with callbacks and the rest with echoHTTP.
func fuzzHandler() Handler {
	hold, web := newHold(), HTTP(echoHTTP())
	hold.closed = nil
	return HandlerFunc(func(s *Stream) StreamHandler {
		if strings.HasPrefix(s.Request().Path, "/hold") {
			return quietHold{hold}
		}
		return web.ServeStream(s)
	})
}

// quietHold is holdHandler without the Closed channel.
type quietHold struct{ *holdHandler }

func (quietHold) Closed(*Stream, error) {}

// FuzzFrames feeds arbitrary bytes after the preface and a SETTINGS frame:
// the server must not panic or hang, and the connection must end once
// the client closes it.
func FuzzFrames(f *testing.F) {
	for _, s := range seedFrames() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		srv, err := New(Config{Handler: fuzzHandler(), Clock: clock.NewFake(t0), MaxQueuedBytes: 64 << 10})
		if err != nil {
			t.Fatal(err)
		}
		client, server := net.Pipe()
		var wg sync.WaitGroup
		wg.Go(func() { srv.ServeConn(server) })
		wg.Go(func() { _, _ = io.Copy(io.Discard, client) })
		var pre bytes.Buffer
		pre.WriteString(http2.ClientPreface)
		_ = http2.NewFramer(&pre, nil).WriteSettings()
		if _, err := client.Write(append(pre.Bytes(), data...)); err == nil {
			client.Close()
		} else {
			client.Close() // the server ended it: fine
		}
		wg.Wait()
		srv.Close()
	})
}

// TestWriteFuzzSeeds writes seedFrames to testdata/fuzz/FuzzFrames when
// H2SERVER_WRITE_SEEDS=1.
func TestWriteFuzzSeeds(t *testing.T) {
	if os.Getenv("H2SERVER_WRITE_SEEDS") != "1" {
		t.Skip("set H2SERVER_WRITE_SEEDS=1 to rewrite testdata/fuzz/FuzzFrames")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzFrames")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, s := range seedFrames() {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%s)\n", strconv.Quote(string(s)))
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("seed%d", i)), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
