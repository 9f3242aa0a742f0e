package loadgen

import (
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// maxOTLPBody caps one export request's body (the SDK's batches are far
// smaller).
const maxOTLPBody = 64 << 20

// OTLPSink is a discarding OTLP/HTTP trace receiver: it accepts POST
// /v1/traces (protobuf, gzip or not), counts the spans and throws them
// away. The storm benchmark points the API and the gateway at it so
// tracing costs what exporting to a real collector costs, and the count
// proves the spans arrived.
type OTLPSink struct {
	spans, requests, rejected atomic.Int64
}

// Spans is the number of spans received; Requests the export requests
// that held them; Rejected the requests that could not be decoded.
func (s *OTLPSink) Spans() int64    { return s.spans.Load() }
func (s *OTLPSink) Requests() int64 { return s.requests.Load() }
func (s *OTLPSink) Rejected() int64 { return s.rejected.Load() }

// ServeHTTP is the /v1/traces endpoint.
func (s *OTLPSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" {
		http.NotFound(w, r)
		return
	}
	var body io.Reader = http.MaxBytesReader(w, r.Body, maxOTLPBody)
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(body)
		if err != nil {
			s.reject(w)
			return
		}
		defer zr.Close()
		body = io.LimitReader(zr, maxOTLPBody)
	}
	b, err := io.ReadAll(body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(b, &req)
	}
	if err != nil {
		s.reject(w)
		return
	}
	n := 0
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			n += len(ss.GetSpans())
		}
	}
	s.spans.Add(int64(n))
	s.requests.Add(1)
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (s *OTLPSink) reject(w http.ResponseWriter) {
	s.rejected.Add(1)
	http.Error(w, "not an OTLP trace export", http.StatusBadRequest)
}

// Serve serves s on ln until ctx ends.
func (s *OTLPSink) Serve(ctx context.Context, ln net.Listener) error {
	hs := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { _ = hs.Close() })
	defer stop()
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
