package tracing

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	// The agent protocol's services, as a process serving it registers them.
	_ "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
)

const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// R17.3: a traceparent within the cap is the caller's context; one over
// it (or a tracestate over its cap) is ignored: the span starts a trace
// of its own.
func TestExtractCapsHeadersR17_3(t *testing.T) {
	for _, c := range []struct {
		name, traceparent, tracestate string
		want                          bool
	}{
		{"valid", parent, "", true},
		{"valid with state", parent, "a=b", true},
		{"giant traceparent", parent + strings.Repeat("0", 1<<16), "", false},
		{"giant tracestate", parent, "a=" + strings.Repeat("b", MaxTracestateBytes), false},
		{"garbage", "not-a-traceparent", "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := http.Header{}
			h.Set("traceparent", c.traceparent)
			if c.tracestate != "" {
				h.Set("tracestate", c.tracestate)
			}
			sc := trace.SpanContextFromContext(Propagator.Extract(context.Background(), propagation.HeaderCarrier(h)))
			if sc.IsValid() != c.want {
				t.Fatalf("extracted %v, want valid=%v", sc, c.want)
			}
		})
	}
}

// R17.3: the server span is named by the RPC procedure, other paths by
// the method only (bounded names), and is a child of the caller's span.
func TestHandlerSpanR17_3(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := NewProvider(Config{}, ServiceAPI, sdktrace.WithSyncer(exp))
	h := Handler(tp, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, span := Start(r.Context(), SpanStoreTx)
		End(span, nil)
	}))
	for _, c := range []struct{ path, want string }{
		{"/bettercompute.agent.v1.JoinService/Join", "bettercompute.agent.v1.JoinService/Join"},
		{"/api/compute/downloads/bcd-linux-amd64", "HTTP POST"},
		{"/readyz", "HTTP POST"},
	} {
		exp.Reset()
		r := httptest.NewRequest(http.MethodPost, c.path, nil)
		r.Header.Set("traceparent", parent)
		h.ServeHTTP(httptest.NewRecorder(), r)
		spans := exp.GetSpans()
		if len(spans) != 2 || spans[1].Name != c.want || spans[0].Name != SpanStoreTx {
			t.Fatalf("%s: spans %v, want store.tx under %q", c.path, spans, c.want)
		}
		if spans[1].Parent.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || spans[0].Parent.SpanID() != spans[1].SpanContext.SpanID() {
			t.Fatalf("%s: not the caller's trace, or store.tx not its child", c.path)
		}
	}
}

// R17.3: tracing is off by default: Setup without an endpoint installs a
// no-op provider, the wrappers return what they wrap, and Start outside a
// recorded span allocates nothing.
func TestOffByDefaultR17_3(t *testing.T) {
	tp, stop, err := Setup(Config{}, ServiceGateway)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stop(context.Background()) }()
	if _, ok := tp.(noop.TracerProvider); !ok {
		t.Fatalf("provider %T, want the no-op one", tp)
	}
	next := http.NewServeMux()
	if h := Handler(nil, next); h != http.Handler(next) {
		t.Fatalf("handler wrapped with tracing off: %T", h)
	}
	if rt := Transport(nil, http.DefaultTransport); rt != http.DefaultTransport {
		t.Fatalf("transport wrapped with tracing off: %T", rt)
	}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() {
		_, span := Start(ctx, SpanStoreTx)
		End(span, nil)
	}); n != 0 {
		t.Fatalf("Start with tracing off: %v allocations, want 0", n)
	}
}

func TestValidate(t *testing.T) {
	half, over := 0.5, 1.5
	for _, c := range []struct {
		c  Config
		ok bool
	}{
		{Config{}, true},
		{Config{OTLPEndpoint: "http://127.0.0.1:4318", SampleRatio: &half}, true},
		{Config{SampleRatio: &over}, false},
		{Config{OTLPEndpoint: "127.0.0.1:4318"}, false},
	} {
		if err := c.c.Validate(); (err == nil) != c.ok {
			t.Errorf("%+v: err %v, want ok=%v", c.c, err, c.ok)
		}
	}
}
