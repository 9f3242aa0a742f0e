package tracing

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// probe serves one request to path carrying a traceparent of traceID
// (random when "") with the sampled flag set.
func probe(h http.Handler, method, path, traceID string) {
	if traceID == "" {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		traceID = hex.EncodeToString(b)
	}
	r := httptest.NewRequest(method, path, nil)
	r.Header.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	h.ServeHTTP(httptest.NewRecorder(), r)
}

// withRatio is a handler on a provider sampling ratio of new traces whose
// spans land in the returned exporter; each request also starts a child
// span, as a transaction would.
func withRatio(ratio float64, opts ...HandlerOption) (http.Handler, *tracetest.InMemoryExporter) {
	exp := tracetest.NewInMemoryExporter()
	tp := NewProvider(Config{SampleRatio: &ratio}, ServiceAPI, sdktrace.WithSyncer(exp))
	return Handler(tp, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, span := Start(r.Context(), SpanStoreTx)
		End(span, nil)
	}), opts...), exp
}

// R23.3: with sample_ratio = 0, 10,000 requests whose traceparent says
// "sampled" export no span: a caller cannot force tracing. A handler that
// trusts its (authenticated) callers follows their flag.
func TestCallerCannotForceSamplingR23_3(t *testing.T) {
	h, exp := withRatio(0)
	for range 10000 {
		probe(h, http.MethodPost, "/bettercompute.agent.v1.JoinService/Join", "")
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans exported at sample_ratio 0 for callers that asked for sampling", n)
	}
	trusting, texp := withRatio(0, TrustCallerSampling())
	probe(trusting, http.MethodPost, "/bettercompute.agent.v1.JoinService/Join", "")
	if n := len(texp.GetSpans()); n != 2 {
		t.Fatalf("%d spans from a trusted caller's sampled call, want 2 (server and child)", n)
	}
}

// R23.3: nor can a caller pick trace ids that a ratio of the id would
// always sample (the low 8 bytes zero): at ratio 0.5 about half of 2,000
// such calls are sampled, not all. (Binomial: 1,500 or more is over 20
// standard deviations out.)
func TestCallerCannotPickSampledIDsR23_3(t *testing.T) {
	h, exp := withRatio(0.5)
	for i := range 2000 {
		probe(h, http.MethodPost, "/readyz", hex.EncodeToString([]byte{1, byte(i >> 8), byte(i), 0, 0, 0, 0, 0})+"0000000000000000")
	}
	if n := len(exp.GetSpans()) / 2; n >= 1500 || n == 0 {
		t.Fatalf("%d of 2000 calls with chosen trace ids sampled at ratio 0.5", n)
	}
}

// R23.3: span names come from the procedures this process serves, never
// from the path a caller made up.
func TestSpanNamesAreNotTheCallersR23_3(t *testing.T) {
	h, exp := withRatio(1)
	for _, c := range []struct{ method, path, want string }{
		{http.MethodPost, "/bettercompute.agent.v1.JoinService/Join", "bettercompute.agent.v1.JoinService/Join"},
		{http.MethodPost, "/api/compute/bettercompute.agent.v1.JoinService/Join", "bettercompute.agent.v1.JoinService/Join"},
		{http.MethodPost, "/bettercompute.agent.v1.JoinService/MadeUpMethod", UnknownSpan},
		{http.MethodPost, "/evil.v1.MadeUpService/MadeUpMethod", UnknownSpan},
		{http.MethodPost, "/a.B/" + strings.Repeat("x", 100), UnknownSpan},
		{http.MethodPost, "/a.b/made-up-name", "HTTP POST"},
		{http.MethodGet, "/api/compute/downloads/bcd/1.2.3/linux-amd64", "HTTP GET"},
		{"MADEUP", "/readyz", UnknownSpan},
	} {
		exp.Reset()
		probe(h, c.method, c.path, "")
		spans := exp.GetSpans()
		if len(spans) != 2 || spans[1].Name != c.want {
			t.Errorf("%s %s: spans %v, want the server span named %q", c.method, c.path, spans, c.want)
		}
		for _, kv := range spans[1].Attributes {
			if kv.Value.AsString() != c.want {
				t.Errorf("%s %s: attribute %s = %q", c.method, c.path, kv.Key, kv.Value.AsString())
			}
		}
	}
}

// R17.3, R23.3: StartServer, for servers that are no http.Handler (a
// session on h2server's callbacks), starts the span Handler starts for
// the same request: its name, kind, attributes and parent, and the same
// sampling, the caller's flag followed only when trusted.
func TestStartServerIsHandlersSpanR17_3(t *testing.T) {
	const (
		path    = "/bettercompute.agent.v1.SessionService/Connect"
		traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	)
	for _, c := range []struct {
		name  string
		ratio float64
		opts  []HandlerOption
	}{
		{"sampled", 1, nil},
		{"caller's flag ignored", 0, nil},
		{"caller's flag trusted", 0, []HandlerOption{TrustCallerSampling()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, hexp := withRatio(c.ratio, c.opts...)
			probe(h, http.MethodPost, path, traceID)
			want := hexp.GetSpans()
			exp := tracetest.NewInMemoryExporter()
			ratio := c.ratio
			tp := NewProvider(Config{SampleRatio: &ratio}, ServiceAPI, sdktrace.WithSyncer(exp))
			header := http.Header{"Traceparent": {"00-" + traceID + "-00f067aa0ba902b7-01"}}
			ctx, span := StartServer(context.Background(), tp, http.MethodPost, path, header, c.opts...)
			_, child := Start(ctx, SpanStoreTx)
			End(child, nil)
			span.End()
			got := exp.GetSpans()
			if len(got) != len(want) {
				t.Fatalf("%d spans, Handler's %d", len(got), len(want))
			}
			for i := range got {
				g, w := got[i], want[i]
				if g.Name != w.Name || g.SpanKind != w.SpanKind || g.SpanContext.TraceID() != w.SpanContext.TraceID() ||
					fmt.Sprint(g.Attributes) != fmt.Sprint(w.Attributes) || g.Status != w.Status {
					t.Errorf("span %d: %s %v %s %v %v, Handler's %s %v %s %v %v", i, g.Name, g.SpanKind, g.SpanContext.TraceID(), g.Attributes, g.Status,
						w.Name, w.SpanKind, w.SpanContext.TraceID(), w.Attributes, w.Status)
				}
			}
			if len(got) == 2 && (got[1].Parent.SpanID().String() != "00f067aa0ba902b7" || got[0].Parent.SpanID() != got[1].SpanContext.SpanID()) {
				t.Errorf("server span's parent %s, child's %s: want the caller's span, then the server span", got[1].Parent.SpanID(), got[0].Parent.SpanID())
			}
		})
	}
}

// R17.3: StartClient starts Transport's client span and puts its context
// in the request's headers; EndClient ends it as Transport does.
func TestStartClientIsTransportsSpanR17_3(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := NewProvider(Config{}, ServiceGateway, sdktrace.WithSyncer(exp))
	ctx, server := StartOn(context.Background(), tp, "server")
	for _, c := range []struct {
		status int
		want   string
	}{
		{http.StatusOK, "http.response.status_code=200"},
		{0, "Error transport"},
	} {
		exp.Reset()
		h := http.Header{}
		span := StartClient(ctx, tp, http.MethodPost, "/bettercompute.agent.v1.SessionService/Connect", h)
		EndClient(span, c.status)
		spans := exp.GetSpans()
		if len(spans) != 1 {
			t.Fatalf("%d spans, want 1", len(spans))
		}
		s := spans[0]
		sc := s.SpanContext
		if hdr := h.Get("Traceparent"); hdr != "00-"+sc.TraceID().String()+"-"+sc.SpanID().String()+"-01" {
			t.Errorf("traceparent %q, want the client span's %s", hdr, sc.SpanID())
		}
		got := s.Status.Code.String() + " " + s.Status.Description
		if len(s.Attributes) == 1 {
			got = string(s.Attributes[0].Key) + "=" + s.Attributes[0].Value.Emit()
		}
		if s.Name != "bettercompute.agent.v1.SessionService/Connect" || s.SpanKind != trace.SpanKindClient || s.Parent.SpanID() != server.SpanContext().SpanID() || got != c.want {
			t.Errorf("status %d: span %s %v under %s, %s; want the procedure, a client span under the server's, %s", c.status, s.Name, s.SpanKind, s.Parent.SpanID(), got, c.want)
		}
	}
	server.End()
}
