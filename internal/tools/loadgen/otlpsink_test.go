package loadgen

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// R17.3: the sink counts every span the real OTLP/HTTP exporter sends it
// (gzip and not), and refuses what is not an export.
func TestOTLPSinkCountsSpansR17_3(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var sink OTLPSink
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sink.Serve(ctx, ln) }()
	defer func() { cancel(); <-done }()
	url := "http://" + ln.Addr().String()

	want := int64(0)
	for _, c := range []otlptracehttp.Compression{otlptracehttp.NoCompression, otlptracehttp.GzipCompression} {
		exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(url+"/v1/traces"), otlptracehttp.WithCompression(c))
		if err != nil {
			t.Fatal(err)
		}
		tp := tracing.NewProvider(tracing.Config{}, "test", sdktrace.WithBatcher(exp))
		for range 25 {
			_, span := tp.Tracer("test").Start(context.Background(), "span")
			span.End()
		}
		// Shutdown flushes the batch and returns once it was sent.
		if err := tp.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		want += 25
		if got := sink.Spans(); got != want {
			t.Errorf("compression %v: %d spans, want %d", c, got, want)
		}
	}
	res, err := http.Post(url+"/v1/traces", "application/x-protobuf", http.NoBody)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	// An empty body is a valid (empty) export; garbage is not.
	res, err = http.Post(url+"/v1/traces", "application/x-protobuf", strings.NewReader("\xff\xff\xff"))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusBadRequest || sink.Rejected() != 1 {
		t.Errorf("garbage: %s, %d rejected", res.Status, sink.Rejected())
	}
}
