package tracing

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	otelinst "go.opentelemetry.io/otel/sdk/instrumentation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/better-compute/better-compute/internal/shared/tracing/lite"
)

// otlpExporter is the SDK's exporter over lite.Exporter, the OTLP/HTTP
// exporter written here rather than taken from OpenTelemetry's
// otlptracehttp (see lite/otlp.go). otlp_test.go checks its bodies
// against otlptracehttp's.
type otlpExporter struct{ exp *lite.Exporter }

// newOTLPExporter exports to url, the full /v1/traces URL.
func newOTLPExporter(url string) *otlpExporter { return &otlpExporter{exp: lite.NewExporter(url)} }

// ExportSpans sends spans in one request, retrying what may pass later
// until ctx ends.
func (e *otlpExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	return e.exp.Export(ctx, otlpSpans(spans))
}

// Shutdown has nothing to release: the SDK's batcher flushes before it.
func (e *otlpExporter) Shutdown(context.Context) error { return nil }

// otlpSpans groups spans by resource, then by instrumentation scope.
func otlpSpans(spans []sdktrace.ReadOnlySpan) []*tracepb.ResourceSpans {
	type scopeKey struct {
		res   attribute.Distinct
		scope otelinst.Scope
	}
	var out []*tracepb.ResourceSpans
	byRes := map[attribute.Distinct]*tracepb.ResourceSpans{}
	byScope := map[scopeKey]*tracepb.ScopeSpans{}
	for _, s := range spans {
		res := s.Resource()
		rk := res.Equivalent()
		rs := byRes[rk]
		if rs == nil {
			rs = &tracepb.ResourceSpans{Resource: &resourcepb.Resource{Attributes: lite.OTLPIter(res.Iter())}, SchemaUrl: res.SchemaURL()}
			byRes[rk] = rs
			out = append(out, rs)
		}
		sc := s.InstrumentationScope()
		sk := scopeKey{rk, sc}
		ss := byScope[sk]
		if ss == nil {
			ss = &tracepb.ScopeSpans{SchemaUrl: sc.SchemaURL}
			if sc != (otelinst.Scope{}) {
				ss.Scope = &commonpb.InstrumentationScope{Name: sc.Name, Version: sc.Version, Attributes: lite.OTLPIter(sc.Attributes.Iter())}
			}
			byScope[sk] = ss
			rs.ScopeSpans = append(rs.ScopeSpans, ss)
		}
		ss.Spans = append(ss.Spans, otlpSpan(s))
	}
	return out
}

// otlpSpan is one span.
func otlpSpan(s sdktrace.ReadOnlySpan) *tracepb.Span {
	sc := s.SpanContext()
	tid, sid := sc.TraceID(), sc.SpanID()
	st := s.Status()
	out := &tracepb.Span{
		TraceId:                tid[:],
		SpanId:                 sid[:],
		TraceState:             sc.TraceState().String(),
		Flags:                  lite.OTLPFlags(sc.TraceFlags(), s.Parent()),
		Name:                   s.Name(),
		Kind:                   lite.OTLPKind(s.SpanKind()),
		StartTimeUnixNano:      lite.OTLPTime(s.StartTime()),
		EndTimeUnixNano:        lite.OTLPTime(s.EndTime()),
		Attributes:             lite.OTLPAttrs(s.Attributes()),
		DroppedAttributesCount: lite.Clamp32(s.DroppedAttributes()),
		DroppedEventsCount:     lite.Clamp32(s.DroppedEvents()),
		DroppedLinksCount:      lite.Clamp32(s.DroppedLinks()),
		Status:                 &tracepb.Status{Code: lite.OTLPStatus(st.Code), Message: st.Description},
	}
	if p := s.Parent().SpanID(); p.IsValid() {
		out.ParentSpanId = p[:]
	}
	for _, ev := range s.Events() {
		out.Events = append(out.Events, &tracepb.Span_Event{
			Name:                   ev.Name,
			TimeUnixNano:           lite.OTLPTime(ev.Time),
			Attributes:             lite.OTLPAttrs(ev.Attributes),
			DroppedAttributesCount: lite.Clamp32(ev.DroppedAttributeCount),
		})
	}
	for _, l := range s.Links() {
		ltid, lsid := l.SpanContext.TraceID(), l.SpanContext.SpanID()
		out.Links = append(out.Links, &tracepb.Span_Link{
			TraceId:                ltid[:],
			SpanId:                 lsid[:],
			TraceState:             l.SpanContext.TraceState().String(),
			Attributes:             lite.OTLPAttrs(l.Attributes),
			DroppedAttributesCount: lite.Clamp32(l.DroppedAttributeCount),
			Flags:                  lite.OTLPFlags(l.SpanContext.TraceFlags(), l.SpanContext),
		})
	}
	return out
}
