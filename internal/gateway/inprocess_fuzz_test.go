package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/tasks"
)

// exchange is what one call through a transport looked like from both
// ends: what the handler read, and what the caller got back.
type exchange struct {
	Method, Path, Query, Proto string
	// ReqHeader holds the request headers the caller set.
	ReqHeader http.Header
	ReqBody   string // hex SHA-256 of what the handler read
	Status    int
	// Header is the response header without those net/http's server adds
	// on its own (Date, Content-Length).
	Header  http.Header
	Body    []byte
	Trailer http.Header
}

// fuzzCall is the call FuzzLocalTransport makes and the answer its
// handler gives, in the shapes connect's clients and handlers use.
type fuzzCall struct {
	reqHeader, respHeader, trailer string
	reqBody, respBody              []byte
	status                         int
	chunks                         int
	declare, flush                 bool
}

// handler answers as c says and records what it read into got.
func (c fuzzCall) handler(got *exchange) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		sum := sha256.Sum256(b)
		got.Method, got.Path, got.Query, got.Proto = r.Method, r.URL.Path, r.URL.RawQuery, r.Proto
		got.ReqHeader = http.Header{"X-Fuzz": r.Header.Values("X-Fuzz"), "Content-Type": r.Header.Values("Content-Type")}
		got.ReqBody = hex.EncodeToString(sum[:])
		h := w.Header()
		h.Set("Content-Type", "application/grpc")
		h.Set("X-Answer", c.respHeader)
		if c.declare {
			h.Set("Trailer", "Grpc-Status")
		}
		w.WriteHeader(c.status)
		if c.flush {
			w.(http.Flusher).Flush()
		}
		body := c.respBody
		for i := 0; i < c.chunks && len(body) > 0; i++ {
			n := len(body)/(c.chunks-i) + 1
			n = min(n, len(body))
			_, _ = w.Write(body[:n])
			body = body[n:]
		}
		_, _ = w.Write(body)
		if c.declare {
			h.Set("Grpc-Status", c.trailer)
		}
		h.Set(http.TrailerPrefix+"Grpc-Message", c.trailer)
	})
}

// run makes the call through rt to base and returns the exchange.
func (c fuzzCall) run(t *testing.T, rt http.RoundTripper, base string, got *exchange) exchange {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, base+"/bc.agent.v1.JoinService/Join?x=1", bytes.NewReader(c.reqBody))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/proto")
	req.Header.Set("X-Fuzz", c.reqHeader)
	res, err := rt.RoundTrip(req)
	if err != nil {
		t.Fatalf("RoundTrip: %v", err)
	}
	body, err := io.ReadAll(res.Body)
	_ = res.Body.Close()
	if err != nil {
		t.Fatalf("read the body: %v", err)
	}
	e := *got
	e.Status, e.Body, e.Trailer = res.StatusCode, body, res.Trailer
	e.Header = res.Header.Clone()
	e.Header.Del("Date")
	e.Header.Del("Content-Length")
	return e
}

// headerValue reports whether v passes net/http's checks of a field value
// and survives HTTP/2 unchanged (no leading or trailing space).
func headerValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return v == "" || (v[0] != ' ' && v[0] != '\t' && v[len(v)-1] != ' ' && v[len(v)-1] != '\t')
}

// R12.1, R13.2: the in-process transport (localTransport) is held to net/http's
// HTTP/2 client and server over a real connection, the transport it stands
// in for: for the same call and the same handler, the handler reads the
// same method, path, query, headers and body, and the caller gets the same
// status, headers, body and trailers. The seed corpus runs with every
// `go test`; `go test -fuzz FuzzLocalTransport ./internal/gateway` explores.
func FuzzLocalTransport(f *testing.F) {
	f.Add("v", "a", "0", []byte("req"), []byte("answer"), uint8(0), uint8(1), true, false)
	f.Add("", "", "", []byte{}, []byte{}, uint8(3), uint8(0), false, true)
	f.Add("x y", "é", "2", bytes.Repeat([]byte{7}, 70<<10), bytes.Repeat([]byte{1}, 300<<10), uint8(4), uint8(9), true, true)
	f.Add("a\tb", "b", "13", []byte{0}, []byte("x"), uint8(1), uint8(2), false, false)
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	statuses := []int{http.StatusOK, http.StatusBadRequest, http.StatusNotFound, http.StatusInternalServerError, http.StatusServiceUnavailable}
	f.Fuzz(func(t *testing.T, reqHeader, respHeader, trailer string, reqBody, respBody []byte, status, chunks uint8, declare, flush bool) {
		if !headerValue(reqHeader) || !headerValue(respHeader) || !headerValue(trailer) {
			t.Skip("not a value net/http sends")
		}
		c := fuzzCall{reqHeader: reqHeader, respHeader: respHeader, trailer: trailer, reqBody: reqBody, respBody: respBody,
			status: statuses[int(status)%len(statuses)], chunks: int(chunks % 16), declare: declare, flush: flush}

		var gotRef exchange
		srv := httptest.NewUnstartedServer(c.handler(&gotRef))
		srv.Config.Protocols = &p
		srv.Start()
		defer srv.Close()
		tr := &http.Transport{Protocols: &p, DisableCompression: true}
		defer tr.CloseIdleConnections()
		ref := c.run(t, tr, srv.URL, &gotRef)

		var gotLocal exchange
		local := c.run(t, localTransport{h: c.handler(&gotLocal), tasks: new(tasks.Tracker)}, LocalAPIURL, &gotLocal)

		if ref.Proto != "HTTP/2.0" {
			t.Fatalf("the reference call was %s, not HTTP/2", ref.Proto)
		}
		if d := cmp.Diff(ref, local); d != "" {
			t.Errorf("in process differs from HTTP/2 (-net/http +local):\n%s", d)
		}
		if !slices.Equal(local.Trailer["Grpc-Message"], []string{trailer}) {
			t.Errorf("trailer %v, want Grpc-Message %q", local.Trailer, trailer)
		}
	})
}
