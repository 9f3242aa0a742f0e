package lite_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/tracing/lite"
)

// collector keeps the OTLP requests it is sent, and the traceparent of
// every other request.
type collector struct {
	mu      sync.Mutex
	bodies  [][]byte
	parents []string
}

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	c.mu.Lock()
	defer c.mu.Unlock()
	if r.URL.Path == "/v1/traces" {
		c.bodies = append(c.bodies, b)
	} else {
		c.parents = append(c.parents, r.Header.Get("traceparent"))
	}
}

// spans decodes the spans of every request, in order.
func (c *collector) spans(t *testing.T) *coltracepb.ExportTraceServiceRequest {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	all := &coltracepb.ExportTraceServiceRequest{}
	for _, b := range c.bodies {
		var req coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			t.Fatal(err)
		}
		all.ResourceSpans = append(all.ResourceSpans, req.ResourceSpans...)
	}
	return all
}

// session is what bcd run traces: a session's open (a root span with an
// attribute, an error status), a call under it through Transport (a
// client span whose context goes out as traceparent), a command under it
// (attributes set later, an event, a status), and a span started under a
// context without a recording span (no span).
func session(t *testing.T, tp trace.TracerProvider, srvURL string) {
	ctx, open := lite.StartOn(context.Background(), tp, lite.SpanSessionOpen, trace.WithAttributes(attribute.String(lite.AttrNodeID, "node_1")))
	client := lite.Client(tp, &http.Client{})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srvURL+"/bettercompute.agent.v1.SessionService/Connect", nil)
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	cctx, cmd := lite.StartOn(ctx, tp, lite.SpanCommand)
	cmd.SetAttributes(attribute.String(lite.AttrCommandKind, "node.facts"), attribute.Int("n", 1), attribute.Int("n", 2))
	cmd.AddEvent("verified", trace.WithAttributes(attribute.Bool("ok", true)))
	cmd.SetStatus(codes.Ok, "ignored")
	cmd.SetStatus(codes.Error, "too late")
	_, inner := lite.Start(cctx, "inner")
	inner.End()
	cmd.End()
	lite.End(open, errors.New("refused"))
	_, none := lite.Start(context.Background(), "no parent")
	none.End()
}

// normalize replaces ids by their order of appearance and times by 0, so
// that two runs compare.
func normalize(req *coltracepb.ExportTraceServiceRequest) {
	ids := map[string][]byte{}
	id := func(b []byte) []byte {
		if len(b) == 0 {
			return b
		}
		if n, ok := ids[string(b)]; ok {
			return n
		}
		n := make([]byte, len(b))
		n[len(n)-1] = byte(len(ids) + 1)
		ids[string(b)] = n
		return n
	}
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				s.TraceId, s.SpanId, s.ParentSpanId = id(s.TraceId), id(s.SpanId), id(s.ParentSpanId)
				s.StartTimeUnixNano, s.EndTimeUnixNano = 0, 0
				for _, e := range s.Events {
					e.TimeUnixNano = 0
				}
			}
		}
	}
}

// R17.3: bcd's provider exports what the SDK's provider (the API's and the
// gateway's) exports for the same session, ids and times aside: the same
// spans, parents, kinds, attributes, events, statuses, trace flags, scope
// and resource (service.name), and the same traceparent on the call.
func TestProviderMatchesSDKR17_3(t *testing.T) {
	var ours, theirs collector
	srvOurs, srvTheirs := httptest.NewServer(&ours), httptest.NewServer(&theirs)
	defer srvOurs.Close()
	defer srvTheirs.Close()

	tp := lite.NewProvider(lite.Config{}, lite.ServiceBCD, lite.NewExporter(srvOurs.URL+"/v1/traces"), clock.Real{})
	session(t, tp, srvOurs.URL)
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(srvTheirs.URL+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	sdk := tracing.NewProvider(tracing.Config{}, tracing.ServiceBCD, sdktrace.WithBatcher(exp))
	session(t, sdk, srvTheirs.URL)
	if err := sdk.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}

	got, want := ours.spans(t), theirs.spans(t)
	normalize(got)
	normalize(want)
	if n := len(got.GetResourceSpans()); n != 1 {
		t.Fatalf("%d resource spans, want 1", n)
	}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("exported spans (-SDK +bcd's):\n%s", diff)
	}
	if len(ours.parents) != 1 || len(ours.parents[0]) != 55 || ours.parents[0][53:] != "01" {
		t.Errorf("traceparent %q, want one, sampled", ours.parents)
	}
}

// R23.3: bcd samples as the SDK provider does: sample_ratio 0 records no
// root, and its children and calls carry the unsampled flag; a child of a
// local span follows it; a caller's flag is not followed.
func TestProviderSamplingR23_3(t *testing.T) {
	var c collector
	srv := httptest.NewServer(&c)
	defer srv.Close()
	zero := 0.0
	tp := lite.NewProvider(lite.Config{SampleRatio: &zero}, lite.ServiceBCD, lite.NewExporter(srv.URL+"/v1/traces"), clock.Real{})
	session(t, tp, srv.URL)
	ctx, root := tp.Tracer("t").Start(context.Background(), "root")
	if root.IsRecording() || !root.SpanContext().IsValid() || root.SpanContext().IsSampled() {
		t.Errorf("root at ratio 0: recording %v, context %v", root.IsRecording(), root.SpanContext())
	}
	if _, child := tp.Tracer("t").Start(ctx, "child"); child.IsRecording() || child.SpanContext().TraceID() != root.SpanContext().TraceID() {
		t.Error("a child of an unsampled span is recorded, or in another trace")
	}
	remote := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled, Remote: true}))
	if _, s := tp.Tracer("t").Start(remote, "server"); s.IsRecording() {
		t.Error("a caller's sampled flag decided")
	}
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := len(c.spans(t).GetResourceSpans()); n != 0 {
		t.Errorf("%d resource spans exported at ratio 0", n)
	}
	if len(c.parents) != 1 || c.parents[0][53:] != "00" {
		t.Errorf("traceparent %q, want one, not sampled", c.parents)
	}

	one := 1.0
	for _, r := range []struct {
		ratio float64
		want  bool
	}{{0, false}, {1, true}} {
		p := lite.NewProvider(lite.Config{SampleRatio: &r.ratio}, "x", lite.NewExporter(srv.URL+"/v1/traces"), clock.Real{})
		ctx, local := p.Tracer("t").Start(context.Background(), "local")
		other := lite.NewProvider(lite.Config{SampleRatio: &one}, "x", lite.NewExporter(srv.URL+"/v1/traces"), clock.Real{})
		if _, s := other.Tracer("t").Start(ctx, "child"); s.IsRecording() != r.want {
			t.Errorf("ratio %v: a child of a local span recorded %v, want %v (its parent's decision)", r.ratio, s.IsRecording(), r.want)
		}
		local.End()
		_ = p.Shutdown(context.Background())
		_ = other.Shutdown(context.Background())
	}
}

// R17.3: Setup with an endpoint exports the spans of the provider it
// returns to {endpoint}/v1/traces under the configured service name, and
// its stop flushes them; without one it is the no-op provider.
func TestSetupR17_3(t *testing.T) {
	var c collector
	srv := httptest.NewServer(&c)
	defer srv.Close()
	tp, stop, err := lite.Setup(lite.Config{OTLPEndpoint: srv.URL + "/", ServiceName: "bcd-7"}, lite.ServiceBCD)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _, _, _ = lite.Setup(lite.Config{}, "") }() // the global provider back to a no-op
	if lite.Provider(nil) != tp {
		t.Error("Setup did not make its provider the global one")
	}
	_, span := lite.StartOn(context.Background(), nil, lite.SpanSessionOpen)
	span.End()
	if err := stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	rs := c.spans(t).GetResourceSpans()
	if len(rs) != 1 || rs[0].GetScopeSpans()[0].GetSpans()[0].GetName() != lite.SpanSessionOpen {
		t.Fatalf("exported %v, want one %s span", rs, lite.SpanSessionOpen)
	}
	if attrs := rs[0].GetResource().GetAttributes(); len(attrs) != 1 || attrs[0].GetKey() != "service.name" || attrs[0].GetValue().GetStringValue() != "bcd-7" {
		t.Errorf("resource %v, want service.name bcd-7", attrs)
	}
	if _, _, err := lite.Setup(lite.Config{OTLPEndpoint: "http://"}, "bcd"); err == nil {
		t.Error("an endpoint without a host is accepted")
	}
	off, _, err := lite.Setup(lite.Config{}, lite.ServiceBCD)
	if err != nil || lite.Transport(off, http.DefaultTransport) != http.DefaultTransport {
		t.Errorf("without an endpoint: %T, %v; want the no-op provider", off, err)
	}
}
