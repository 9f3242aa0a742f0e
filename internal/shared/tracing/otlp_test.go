package tracing

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelinst "go.opentelemetry.io/otel/sdk/instrumentation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// collector records the bodies POSTed to it and answers each with the next
// of statuses (200 once they run out).
type collector struct {
	mu       sync.Mutex
	bodies   [][]byte
	types    []string
	statuses []int
	header   http.Header
}

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.bodies = append(c.bodies, b)
	c.types = append(c.types, r.URL.Path+" "+r.Header.Get("Content-Type"))
	status := http.StatusOK
	if len(c.statuses) > 0 {
		status, c.statuses = c.statuses[0], c.statuses[1:]
	}
	for k, v := range c.header {
		w.Header()[k] = v
	}
	w.WriteHeader(status)
}

func (c *collector) requests() ([][]byte, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([][]byte(nil), c.bodies...), append([]string(nil), c.types...)
}

// stubs are spans with every kind of field an exporter must carry.
func stubs() tracetest.SpanStubs {
	res := resource.NewSchemaless(attribute.String("service.name", "bcd"), attribute.Int("n", 3))
	scope := otelinst.Scope{Name: "test", Version: "1.0", SchemaURL: "https://example.com/schema",
		Attributes: attribute.NewSet(attribute.Bool("scoped", true))}
	ts, _ := trace.ParseTraceState("a=1,b=2")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled, TraceState: ts})
	parent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{6}, Remote: true})
	linked := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{9}, SpanID: trace.SpanID{8}, TraceFlags: trace.FlagsSampled})
	start := time.Unix(1_700_000_000, 123)
	attrs := []attribute.KeyValue{
		attribute.Bool("b", true), attribute.Int64("i", -7), attribute.Float64("f", 1.5), attribute.String("s", "x"),
		attribute.BoolSlice("bs", []bool{true, false}), attribute.Int64Slice("is", []int64{1, 2}),
		attribute.Float64Slice("fs", []float64{0.5}), attribute.StringSlice("ss", []string{"a", "b"}),
	}
	return tracetest.SpanStubs{
		{
			Name: "bcd.session.open", SpanContext: sc, Parent: parent, SpanKind: trace.SpanKindClient,
			StartTime: start, EndTime: start.Add(time.Second), Attributes: attrs,
			Events:            []sdktrace.Event{{Name: "ev", Time: start.Add(time.Millisecond), Attributes: attrs[:2], DroppedAttributeCount: 1}},
			Links:             []sdktrace.Link{{SpanContext: linked, Attributes: attrs[2:3], DroppedAttributeCount: 2}},
			Status:            sdktrace.Status{Code: codes.Error, Description: "UNAVAILABLE"},
			DroppedAttributes: 1, DroppedEvents: 2, DroppedLinks: 3,
			Resource: res, InstrumentationScope: scope,
		},
		{Name: "child", SpanContext: trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{7}}),
			Parent: sc, SpanKind: trace.SpanKindServer, StartTime: start, EndTime: start, Resource: res, InstrumentationScope: scope},
		{Name: "other scope", SpanKind: trace.SpanKindInternal, StartTime: start, EndTime: start, Resource: res,
			InstrumentationScope: otelinst.Scope{Name: "other"}, Status: sdktrace.Status{Code: codes.Ok}},
	}
}

// R17.3: what the exporter sends is what OpenTelemetry's own OTLP/HTTP
// exporter sends for the same spans, to the same path with the same
// content type, decoded as the collector decodes it.
func TestOTLPBodyMatchesOpenTelemetryR17_3(t *testing.T) {
	var ours, theirs collector
	srvOurs, srvTheirs := httptest.NewServer(&ours), httptest.NewServer(&theirs)
	defer srvOurs.Close()
	defer srvTheirs.Close()
	spans := stubs().Snapshots()

	if err := newOTLPExporter(srvOurs.URL+"/v1/traces").ExportSpans(context.Background(), spans); err != nil {
		t.Fatal(err)
	}
	ref, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(srvTheirs.URL+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	if err := ref.ExportSpans(context.Background(), spans); err != nil {
		t.Fatal(err)
	}
	gotBodies, gotTypes := ours.requests()
	wantBodies, wantTypes := theirs.requests()
	if len(gotBodies) != 1 || len(wantBodies) != 1 {
		t.Fatalf("%d requests, reference %d; want 1 each", len(gotBodies), len(wantBodies))
	}
	if diff := cmp.Diff(wantTypes, gotTypes); diff != "" {
		t.Errorf("path and content type (-reference +ours):\n%s", diff)
	}
	var got, want coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(gotBodies[0], &got); err != nil {
		t.Fatal(err)
	}
	if err := proto.Unmarshal(wantBodies[0], &want); err != nil {
		t.Fatal(err)
	}
	if n := len(got.GetResourceSpans()); n != 1 {
		t.Fatalf("%d resource spans, want 1", n)
	}
	if diff := cmp.Diff(&want, &got, protocmp.Transform()); diff != "" {
		t.Errorf("export request (-reference +ours):\n%s", diff)
	}
}

// R17.3: a collector that is overloaded (429, 502, 503, 504) gets the batch
// again after its Retry-After; one that refuses it (400) does not.
func TestOTLPRetriesR17_3(t *testing.T) {
	c := &collector{statuses: []int{http.StatusServiceUnavailable}, header: http.Header{"Retry-After": {"3"}}}
	srv := httptest.NewServer(c)
	defer srv.Close()
	fake := clock.NewFake(time.Unix(1_700_000_000, 0))
	e := newOTLPExporter(srv.URL + "/v1/traces")
	e.exp.Clock = fake
	done := make(chan error, 1)
	go func() { done <- e.ExportSpans(context.Background(), stubs().Snapshots()) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := fake.WaitArmed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if d := fake.Deadlines(); len(d) != 1 || d[0].Sub(fake.Now()) != 3*time.Second {
		t.Fatalf("waits until %v, want 3s from now (Retry-After)", d)
	}
	fake.Advance(3 * time.Second)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if bodies, _ := c.requests(); len(bodies) != 2 || string(bodies[0]) != string(bodies[1]) {
		t.Fatalf("%d requests, want the same body twice", len(bodies))
	}

	bad := &collector{statuses: []int{http.StatusBadRequest}}
	srvBad := httptest.NewServer(bad)
	defer srvBad.Close()
	err := newOTLPExporter(srvBad.URL+"/v1/traces").ExportSpans(context.Background(), stubs().Snapshots())
	if err == nil || !strings.Contains(err.Error(), "400") {
		t.Fatalf("refused export: %v, want the 400", err)
	}
	if bodies, _ := bad.requests(); len(bodies) != 1 {
		t.Fatalf("%d requests after a 400, want 1", len(bodies))
	}
}

// R17.3: Setup with an endpoint exports the spans of the provider it
// returns to {endpoint}/v1/traces, and its stop flushes them.
func TestSetupExportsR17_3(t *testing.T) {
	c := &collector{}
	srv := httptest.NewServer(c)
	defer srv.Close()
	tp, stop, err := Setup(Config{OTLPEndpoint: srv.URL + "/"}, "bcd")
	if err != nil {
		t.Fatal(err)
	}
	defer Setup(Config{}, "") // the global provider back to a no-op
	_, span := StartOn(context.Background(), tp, SpanSessionOpen)
	span.End()
	if err := stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	bodies, types := c.requests()
	if len(bodies) != 1 || types[0] != "/v1/traces application/x-protobuf" {
		t.Fatalf("requests %q, want one to /v1/traces", types)
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(bodies[0], &req); err != nil {
		t.Fatal(err)
	}
	if n := req.GetResourceSpans()[0].GetScopeSpans()[0].GetSpans()[0].GetName(); n != SpanSessionOpen {
		t.Errorf("span %q, want %q", n, SpanSessionOpen)
	}
	if _, _, err := Setup(Config{OTLPEndpoint: "http://"}, "bcd"); err == nil {
		t.Error("an endpoint without a host is accepted")
	}
}
