package h2server

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/net/http2"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// relayEcho serves gRPC bidi streams the way the gateway's session relay
// would: no goroutine per stream. Callbacks on the connection's goroutine
// cut the messages and hand them to one "upstream" goroutine for every
// stream (here it echoes them); it writes back with the Stream's methods
// and returns the receive window once a message has left.
type relayEcho struct {
	up   chan upMsg
	wg   sync.WaitGroup
	mu   sync.Mutex
	msgs map[*Stream]*Messages
}

type upMsg struct {
	s   *Stream
	msg []byte // nil: the client ended its side
	n   int    // the bytes of window it held
}

func newRelayEcho() *relayEcho {
	r := &relayEcho{up: make(chan upMsg, 64), msgs: map[*Stream]*Messages{}}
	r.wg.Go(r.pump)
	return r
}

func (r *relayEcho) stop() { close(r.up); r.wg.Wait() }

func (r *relayEcho) ServeStream(s *Stream) StreamHandler {
	if s.Request().Header.Get("Content-Type") != "application/grpc" {
		_ = s.WriteHeaders(http.StatusUnsupportedMediaType, nil, true)
		return nil
	}
	_ = s.WriteHeaders(200, http.Header{"Content-Type": {"application/grpc"}}, false)
	r.mu.Lock()
	r.msgs[s] = &Messages{Max: 64 << 10}
	r.mu.Unlock()
	return r
}

func (r *relayEcho) Data(s *Stream, p []byte, end bool) {
	r.mu.Lock()
	m := r.msgs[s]
	r.mu.Unlock()
	// The window of a message goes back once it has left (pump); the
	// bytes of an unfinished one at once.
	held, err := m.Feed(p, func(_ byte, msg []byte, window int) error {
		r.up <- upMsg{s: s, msg: append([]byte{}, msg...), n: window}
		return nil
	})
	if err != nil {
		s.Reset(http2.ErrCodeProtocol)
		return
	}
	s.Consumed(held)
	if end {
		r.up <- upMsg{s: s}
	}
}

func (r *relayEcho) Sent(*Stream, int) {}

func (r *relayEcho) Closed(s *Stream, err error) {
	r.mu.Lock()
	delete(r.msgs, s)
	r.mu.Unlock()
}

// pump is the upstream side: it writes from its own goroutine.
func (r *relayEcho) pump() {
	for m := range r.up {
		if m.msg == nil {
			_ = m.s.WriteTrailers(http.Header{"Grpc-Status": {"0"}})
			continue
		}
		var v wrapperspb.BytesValue
		if proto.Unmarshal(m.msg, &v) == nil && string(v.Value) == "fail" {
			_ = m.s.WriteTrailers(http.Header{"Grpc-Status": {"3"}, "Grpc-Message": {"refused"}})
			continue
		}
		_ = m.s.Write(AppendMessage(nil, 0, m.msg))
		m.s.Consumed(m.n)
	}
}

// TestGRPCBidiRelay: connect-go's gRPC client against callback streams,
// over x/net's client and TLS: messages both ways on several streams at
// once, larger than a frame, grpc-status in the trailers, and an error
// status.
func TestGRPCBidiRelay(t *testing.T) {
	relay := newRelayEcho()
	t.Cleanup(relay.stop) // after the server's Close: cleanups run last first
	_, addr, pool := startTLS(t, Config{Handler: relay})
	client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](x2Client(pool), "https://"+addr+"/test.v1.Echo/Bidi",
		connect.WithGRPC(), connect.WithSendMaxBytes(64<<10), connect.WithReadMaxBytes(64<<10))
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			stream := client.CallBidiStream(context.Background())
			for j := range 20 {
				want := bytes.Repeat([]byte{byte('a' + j)}, 1+(i*j*997)%40000)
				if err := stream.Send(wrapperspb.Bytes(want)); err != nil {
					t.Errorf("stream %d: send %d: %v", i, j, err)
					return
				}
				got, err := stream.Receive()
				if err != nil || !bytes.Equal(got.GetValue(), want) {
					t.Errorf("stream %d: message %d: %d bytes, %v", i, j, len(got.GetValue()), err)
					return
				}
			}
			if err := stream.CloseRequest(); err != nil {
				t.Error(err)
			}
			if _, err := stream.Receive(); !errors.Is(err, io.EOF) {
				t.Errorf("stream %d: after the end: %v", i, err)
			}
			_ = stream.CloseResponse()
		})
	}
	wg.Wait()

	stream := client.CallBidiStream(context.Background())
	_ = stream.Send(wrapperspb.Bytes([]byte("fail")))
	_, err := stream.Receive()
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !bytes.Contains([]byte(err.Error()), []byte("refused")) {
		t.Fatalf("error status: %v", err)
	}
	_ = stream.CloseRequest()
	_ = stream.CloseResponse()
}
