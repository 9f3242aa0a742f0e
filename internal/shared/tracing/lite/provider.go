package lite

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// The batching of ended spans, as the SDK's batch span processor's
// defaults: a batch goes out when it holds batchSize spans or batchDelay
// after the last one went; beyond queueSize waiting spans, new ones are
// dropped; one export gets exportTimeout, its retries included.
const (
	batchSize     = 512
	queueSize     = 2048
	batchDelay    = 5 * time.Second
	exportTimeout = 30 * time.Second
)

// Setup builds bcd's provider c describes (the service named service
// unless c names one) and makes it the global one (what Provider(nil)
// returns). Without an endpoint it is a no-op provider. The returned
// function exports what is left and stops it.
//
// It samples as the API's and the gateway's SDK provider does (Sampled),
// gives every span its parent's trace (a new one for a root), and exports
// over OTLP/HTTP with the resource attribute service.name.
func Setup(c Config, service string) (trace.TracerProvider, func(context.Context) error, error) {
	if err := c.Validate(); err != nil {
		return nil, nil, err
	}
	if c.OTLPEndpoint == "" {
		tp := noop.NewTracerProvider()
		SetProvider(tp)
		return tp, func(context.Context) error { return nil }, nil
	}
	if u, err := url.Parse(c.OTLPEndpoint); err != nil || u.Host == "" {
		return nil, nil, errs.New(errs.InvalidConfig, "tracing.otlp_endpoint: not a URL with a host: %q", c.OTLPEndpoint)
	}
	tp := NewProvider(c, service, NewExporter(strings.TrimSuffix(c.OTLPEndpoint, "/")+"/v1/traces"), clock.Real{})
	SetProvider(tp)
	return tp, tp.Shutdown, nil
}

// TracerProvider is bcd's tracer provider: spans recorded here, exported
// in batches by one goroutine, which Shutdown waits for.
type TracerProvider struct {
	embedded.TracerProvider
	ratio    float64
	resource *resourcepb.Resource
	exp      *Exporter
	clock    clock.Clock

	mu      sync.Mutex
	queue   []*span
	stopped bool
	kick    chan struct{} // a full batch is waiting
	stop    chan struct{}
	done    chan struct{}
}

// NewProvider is the provider c describes, exporting to exp; it starts the
// exporting goroutine (stopped by Shutdown).
func NewProvider(c Config, service string, exp *Exporter, clk clock.Clock) *TracerProvider {
	if c.ServiceName != "" {
		service = c.ServiceName
	}
	ratio := 1.0
	if c.SampleRatio != nil {
		ratio = *c.SampleRatio
	}
	tp := &TracerProvider{
		ratio: ratio, exp: exp, clock: clk,
		resource: &resourcepb.Resource{Attributes: OTLPAttrs([]attribute.KeyValue{attribute.String("service.name", service)})},
		kick:     make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go tp.run()
	return tp
}

// Tracer is a tracer whose spans carry the instrumentation scope name
// (and the version in opts).
func (tp *TracerProvider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	c := trace.NewTracerConfig(opts...)
	return &tracer{tp: tp, scope: &commonpb.InstrumentationScope{Name: name, Version: c.InstrumentationVersion()}, schemaURL: c.SchemaURL()}
}

// Shutdown exports the spans that ended and stops the provider; spans
// that end afterwards are dropped.
func (tp *TracerProvider) Shutdown(ctx context.Context) error {
	tp.mu.Lock()
	if !tp.stopped {
		tp.stopped = true
		close(tp.stop)
	}
	tp.mu.Unlock()
	select {
	case <-tp.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// enqueue takes an ended span for the next batch.
func (tp *TracerProvider) enqueue(s *span) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if tp.stopped || len(tp.queue) >= queueSize {
		return
	}
	tp.queue = append(tp.queue, s)
	if len(tp.queue) >= batchSize {
		select {
		case tp.kick <- struct{}{}:
		default:
		}
	}
}

// run exports a batch when one is full, batchDelay after the last export,
// and what is left once stopped.
func (tp *TracerProvider) run() {
	defer close(tp.done)
	t := tp.clock.NewTimer(batchDelay)
	defer t.Stop()
	for {
		select {
		case <-tp.stop:
			for tp.export() > 0 {
			}
			return
		case <-tp.kick:
		case <-t.C():
		}
		tp.export()
		t.Reset(batchDelay)
	}
}

// export sends up to batchSize waiting spans and returns how many.
func (tp *TracerProvider) export() int {
	tp.mu.Lock()
	n := min(len(tp.queue), batchSize)
	batch := tp.queue[:n:n]
	tp.queue = tp.queue[n:]
	tp.mu.Unlock()
	if n == 0 {
		return 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), exportTimeout)
	defer cancel()
	// As the SDK's batcher: a batch that cannot be sent is dropped.
	_ = tp.exp.Export(ctx, tp.otlp(batch))
	return n
}

// otlp is batch under the provider's resource, grouped by scope.
func (tp *TracerProvider) otlp(batch []*span) []*tracepb.ResourceSpans {
	rs := &tracepb.ResourceSpans{Resource: tp.resource}
	type scopeKey struct{ name, version, schemaURL string }
	byScope := map[scopeKey]*tracepb.ScopeSpans{}
	for _, s := range batch {
		t := s.tracer
		k := scopeKey{t.scope.GetName(), t.scope.GetVersion(), t.schemaURL}
		ss := byScope[k]
		if ss == nil {
			ss = &tracepb.ScopeSpans{Scope: t.scope, SchemaUrl: t.schemaURL}
			byScope[k] = ss
			rs.ScopeSpans = append(rs.ScopeSpans, ss)
		}
		ss.Spans = append(ss.Spans, s.otlp())
	}
	return []*tracepb.ResourceSpans{rs}
}

type tracer struct {
	embedded.Tracer
	tp        *TracerProvider
	scope     *commonpb.InstrumentationScope
	schemaURL string
}

// Start starts a span, a child of ctx's span context (a new trace without
// one, or with trace.WithNewRoot), recorded when Sampled says so.
func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if ctx == nil {
		ctx = context.Background()
	}
	c := trace.NewSpanStartConfig(opts...)
	parent := trace.SpanContextFromContext(ctx)
	if c.NewRoot() {
		parent = trace.SpanContext{}
		ctx = trace.ContextWithSpanContext(ctx, parent)
	}
	cfg := trace.SpanContextConfig{TraceID: parent.TraceID(), SpanID: newSpanID(), TraceState: parent.TraceState()}
	if !parent.IsValid() {
		cfg.TraceID = newTraceID()
	}
	if Sampled(ctx, cfg.TraceID, t.tp.ratio) {
		cfg.TraceFlags = parent.TraceFlags() | trace.FlagsSampled
	} else {
		cfg.TraceFlags = parent.TraceFlags() &^ trace.FlagsSampled
	}
	sc := trace.NewSpanContext(cfg)
	if !sc.IsSampled() {
		return trace.ContextWithSpan(ctx, unsampled{sc: sc, tp: t.tp}), unsampled{sc: sc, tp: t.tp}
	}
	start := c.Timestamp()
	if start.IsZero() {
		start = t.tp.clock.Now()
	}
	kind := c.SpanKind()
	if kind == trace.SpanKindUnspecified {
		kind = trace.SpanKindInternal
	}
	s := &span{tracer: t, sc: sc, parent: parent, name: name, kind: kind, start: start,
		attrs: append([]attribute.KeyValue(nil), c.Attributes()...), links: c.Links()}
	return trace.ContextWithSpan(ctx, s), s
}

// Sampled decides whether a span of trace tid, under ctx's span context,
// is recorded and exported (R23.3); the SDK's sampler decides the same.
//
//   - A root span (no parent): the configured ratio of trace ids, which
//     this process generated.
//   - A child of a span of this process: as its parent, so a trace is
//     whole or absent.
//   - A child of a caller's span (a traceparent header): as the caller
//     said only when the handler trusts the caller (TrustedCaller);
//     otherwise the ratio, drawn at random. SECURITY: the sampled flag
//     and the trace id are the caller's to choose, so neither may decide:
//     honouring the flag let any unauthenticated request be traced and
//     exported with sample_ratio = 0, and a ratio of the trace id would
//     let a caller pick ids that are always sampled.
func Sampled(ctx context.Context, tid trace.TraceID, ratio float64) bool {
	psc := trace.SpanContextFromContext(ctx)
	switch {
	case !psc.IsValid():
		// As the SDK's TraceIDRatioBased: the low 63 bits of the id's
		// second half below ratio of their range.
		if ratio >= 1 {
			return true
		}
		bound := uint64(max(ratio, 0) * (1 << 63))
		return binary.BigEndian.Uint64(tid[8:16])>>1 < bound
	case !psc.IsRemote() || TrustedCaller(ctx):
		return psc.IsSampled()
	}
	return ratio >= 1 || (ratio > 0 && rand.Float64() < ratio)
}

func newTraceID() trace.TraceID {
	var id trace.TraceID
	for !id.IsValid() {
		binary.BigEndian.PutUint64(id[:8], rand.Uint64())
		binary.BigEndian.PutUint64(id[8:], rand.Uint64())
	}
	return id
}

func newSpanID() trace.SpanID {
	var id trace.SpanID
	for !id.IsValid() {
		binary.BigEndian.PutUint64(id[:], rand.Uint64())
	}
	return id
}

// unsampled is a span that is not recorded: it carries its context, so
// that its children and the calls it makes follow its decision.
type unsampled struct {
	noop.Span
	sc trace.SpanContext
	tp *TracerProvider
}

func (u unsampled) SpanContext() trace.SpanContext       { return u.sc }
func (u unsampled) TracerProvider() trace.TracerProvider { return u.tp }

// span is a recorded span, exported once it ends.
type span struct {
	embedded.Span
	tracer *tracer
	sc     trace.SpanContext
	parent trace.SpanContext
	kind   trace.SpanKind
	start  time.Time

	mu         sync.Mutex
	name       string
	end        time.Time
	ended      bool
	attrs      []attribute.KeyValue
	events     []*tracepb.Span_Event
	links      []trace.Link
	status     codes.Code
	statusDesc string
}

func (s *span) SpanContext() trace.SpanContext       { return s.sc }
func (s *span) TracerProvider() trace.TracerProvider { return s.tracer.tp }

func (s *span) IsRecording() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.ended
}

// update runs f on the span unless it ended.
func (s *span) update(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended {
		f()
	}
}

// SetAttributes sets attributes, a later value of a key replacing the
// earlier one.
func (s *span) SetAttributes(kv ...attribute.KeyValue) {
	s.update(func() {
		for _, a := range kv {
			if !a.Valid() {
				continue
			}
			i := 0
			for i < len(s.attrs) && s.attrs[i].Key != a.Key {
				i++
			}
			if i < len(s.attrs) {
				s.attrs[i] = a
			} else {
				s.attrs = append(s.attrs, a)
			}
		}
	})
}

// SetStatus sets the status as the SDK does: Ok is final, Error keeps its
// description, Unset changes nothing.
func (s *span) SetStatus(code codes.Code, description string) {
	s.update(func() {
		if code == codes.Unset || s.status == codes.Ok {
			return
		}
		s.status, s.statusDesc = code, ""
		if code == codes.Error {
			s.statusDesc = description
		}
	})
}

func (s *span) SetName(name string) { s.update(func() { s.name = name }) }

func (s *span) AddLink(l trace.Link) {
	if l.SpanContext.IsValid() {
		s.update(func() { s.links = append(s.links, l) })
	}
}

func (s *span) AddEvent(name string, opts ...trace.EventOption) {
	c := trace.NewEventConfig(opts...)
	t := c.Timestamp()
	if t.IsZero() {
		t = s.tracer.tp.clock.Now()
	}
	s.update(func() {
		s.events = append(s.events, &tracepb.Span_Event{Name: name, TimeUnixNano: OTLPTime(t), Attributes: OTLPAttrs(c.Attributes())})
	})
}

// RecordError is an "exception" event, as the SDK records one.
func (s *span) RecordError(err error, opts ...trace.EventOption) {
	if err == nil {
		return
	}
	opts = append(opts, trace.WithAttributes(attribute.String("exception.type", errType(err)), attribute.String("exception.message", err.Error())))
	s.AddEvent("exception", opts...)
}

// errType names err's type as the SDK does.
func errType(err error) string {
	t := reflect.TypeOf(err)
	if t.PkgPath() == "" && t.Name() == "" {
		return t.String()
	}
	return t.PkgPath() + "." + t.Name()
}

// End ends the span (once) and queues it for export.
func (s *span) End(opts ...trace.SpanEndOption) {
	c := trace.NewSpanEndConfig(opts...)
	end := c.Timestamp()
	if end.IsZero() {
		end = s.tracer.tp.clock.Now()
	}
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended, s.end = true, end
	s.mu.Unlock()
	s.tracer.tp.enqueue(s)
}

// otlp is the ended span as OTLP.
func (s *span) otlp() *tracepb.Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	tid, sid := s.sc.TraceID(), s.sc.SpanID()
	out := &tracepb.Span{
		TraceId: tid[:], SpanId: sid[:], TraceState: s.sc.TraceState().String(),
		Flags: OTLPFlags(s.sc.TraceFlags(), s.parent), Name: s.name, Kind: OTLPKind(s.kind),
		StartTimeUnixNano: OTLPTime(s.start), EndTimeUnixNano: OTLPTime(s.end),
		Attributes: OTLPAttrs(s.attrs), Events: s.events,
		Status: &tracepb.Status{Code: OTLPStatus(s.status), Message: s.statusDesc},
	}
	if p := s.parent.SpanID(); p.IsValid() {
		out.ParentSpanId = p[:]
	}
	for _, l := range s.links {
		ltid, lsid := l.SpanContext.TraceID(), l.SpanContext.SpanID()
		out.Links = append(out.Links, &tracepb.Span_Link{
			TraceId: ltid[:], SpanId: lsid[:], TraceState: l.SpanContext.TraceState().String(),
			Attributes: OTLPAttrs(l.Attributes), Flags: OTLPFlags(l.SpanContext.TraceFlags(), l.SpanContext),
		})
	}
	return out
}
