// Package wiretest sends calls built by hand to a real server, so tests can
// send what no client would (a gzip bomb, a compressed envelope), and
// counts what the server read of them. Tests of the API and the gateway
// import it; nothing else may.
package wiretest

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/better-compute/better-compute/gen/bettercompute/v1/bcv1connect"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// GzipBomb returns a gzip body that inflates to inflated bytes (rounded
// up to whole MiB) of zeros, at about 1/1000 of that: one member of
// 1 MiB of zeros repeated, which gzip readers inflate as one stream. Tests
// send it to show a server refuses it without inflating it.
func GzipBomb(t testing.TB, inflated int64) []byte {
	t.Helper()
	var member bytes.Buffer
	zw, err := gzip.NewWriterLevel(&member, gzip.BestCompression)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := zw.Write(make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	n := int((inflated + 1<<20 - 1) >> 20)
	return bytes.Repeat(member.Bytes(), n)
}

// CountBody serves h with every request body counted: the returned counter
// is the number of body bytes h read, across requests.
func CountBody(h http.Handler) (http.Handler, *atomic.Int64) {
	n := new(atomic.Int64)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = countingBody{r.Body, n}
		h.ServeHTTP(w, r)
	}), n
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// RawCall is one call built by hand, so a test can send what no client
// would: Protocol "connect" (unary, JSON) or "grpc" (one envelope, JSON
// codec), Body sent as it is and flagged compressed when Gzip is set.
type RawCall struct {
	// Path defaults to the operator API's TenantService.ListTenants.
	Path     string
	Protocol string
	// ContentType replaces the protocol's (JSON codec) content type.
	ContentType string
	// Key, when set, is sent as the bearer API key.
	Key  string
	Gzip bool
	Body []byte
}

// Do sends c to url and returns the answer's RPC code: the Connect code
// ("unauthenticated"), "grpc-status N", or the HTTP status when neither.
func (c RawCall) Do(t testing.TB, hc *http.Client, url string) string {
	t.Helper()
	body, ctype := c.Body, "application/json"
	if c.Protocol == "grpc" {
		env := make([]byte, 5, 5+len(body))
		if c.Gzip {
			env[0] = 1
		}
		binary.BigEndian.PutUint32(env[1:], uint32(len(body)))
		body, ctype = append(env, body...), "application/grpc+json"
	}
	if c.ContentType != "" {
		ctype = c.ContentType
	}
	path := c.Path
	if path == "" {
		path = wire.DefaultBasePath + bcv1connect.TenantServiceListTenantsProcedure
	}
	req, err := http.NewRequest(http.MethodPost, url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ctype)
	if c.Key != "" {
		req.Header.Set("Authorization", "Bearer "+c.Key)
	}
	switch {
	case c.Gzip && c.Protocol == "grpc":
		req.Header.Set("Grpc-Encoding", "gzip")
	case c.Gzip:
		req.Header.Set("Content-Encoding", "gzip")
	}
	if c.Protocol == "grpc" {
		req.Header.Set("Te", "trailers")
	} else {
		req.Header.Set("Connect-Protocol-Version", "1")
	}
	res, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	out, _ := io.ReadAll(res.Body)
	if c.Protocol == "grpc" {
		if s := res.Header.Get("Grpc-Status"); s != "" {
			return "grpc-status " + s
		}
		return "grpc-status " + res.Trailer.Get("Grpc-Status")
	}
	var e struct{ Code string }
	_ = json.Unmarshal(out, &e)
	if e.Code == "" {
		return res.Status
	}
	return e.Code
}
