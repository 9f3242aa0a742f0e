package lite

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// The exporter is OTLP/HTTP with protobuf bodies, written here rather than
// taken from OpenTelemetry's otlptracehttp: that package links gRPC and
// grpc-gateway (its options and its collector types are shared with the
// gRPC exporter), several megabytes that bcd, which runs on every machine,
// would carry for nothing. The request body is a TracesData, which the
// OTLP specification defines to be byte-for-byte an
// ExportTraceServiceRequest, so the collector's types are not needed
// either. otlp_test.go checks the bodies against otlptracehttp's.

// otlpRetry is the wait between attempts of one export: a collector that
// answers 429, 502, 503 or 504, or that cannot be reached, is tried again
// until the batch's deadline (the SDK gives each export 30 seconds).
var otlpRetry = backoff.Policy{Min: time.Second, Max: 10 * time.Second, Jitter: backoff.DefaultJitter}

// OTLPTimeout bounds one attempt.
const otlpTimeout = 10 * time.Second

// maxOTLPError is how much of a refused export's body goes into the error.
const maxOTLPError = 1 << 10

// Exporter posts spans to an OTLP/HTTP collector's /v1/traces.
type Exporter struct {
	url    string
	client *http.Client
	// Clock times the waits between attempts.
	Clock clock.Clock
}

// NewExporter exports to url, the full /v1/traces URL.
func NewExporter(url string) *Exporter {
	return &Exporter{url: url, client: &http.Client{Timeout: otlpTimeout}, Clock: clock.Real{}}
}

// Export sends spans in one request, retrying what may pass later until
// ctx ends.
func (e *Exporter) Export(ctx context.Context, spans []*tracepb.ResourceSpans) error {
	if len(spans) == 0 {
		return nil
	}
	body, err := proto.Marshal(&tracepb.TracesData{ResourceSpans: spans})
	if err != nil {
		return fmt.Errorf("otlp: encoding spans: %w", err)
	}
	for attempt := 1; ; attempt++ {
		retry, wait, err := e.post(ctx, body)
		if !retry {
			return err
		}
		if wait <= 0 {
			wait = otlpRetry.Spread(attempt, rand.Float64())
		}
		if !clock.Sleep(e.Clock, ctx.Done(), wait) {
			return fmt.Errorf("%w (gave up: %w)", err, ctx.Err())
		}
	}
}

// post makes one attempt. retry says whether another may succeed; wait is
// the collector's Retry-After, if it sent one.
func (e *Exporter) post(ctx context.Context, body []byte) (retry bool, wait time.Duration, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url, bytes.NewReader(body))
	if err != nil {
		return false, 0, fmt.Errorf("otlp: %w", err)
	}
	req.Header.Set("Content-Type", "application/x-protobuf")
	res, err := e.client.Do(req)
	if err != nil {
		return ctx.Err() == nil, 0, fmt.Errorf("otlp: %w", err)
	}
	defer res.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(res.Body, maxOTLPError))
	_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 64<<10))
	if res.StatusCode/100 == 2 {
		return false, 0, nil
	}
	err = fmt.Errorf("otlp: %s answered %s: %q", e.url, res.Status, msg)
	switch res.StatusCode {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		if s, perr := strconv.Atoi(res.Header.Get("Retry-After")); perr == nil && s > 0 {
			wait = min(time.Duration(s)*time.Second, otlpRetry.Max)
		}
		return true, wait, err
	}
	return false, 0, err
}

// OTLPFlags is the W3C trace flags and whether parent is remote (the high
// bit says that the low one is known).
func OTLPFlags(tf trace.TraceFlags, parent trace.SpanContext) uint32 {
	f := uint32(tf) | uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
	if parent.IsRemote() {
		f |= uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)
	}
	return f
}

func OTLPKind(k trace.SpanKind) tracepb.Span_SpanKind {
	switch k {
	case trace.SpanKindInternal:
		return tracepb.Span_SPAN_KIND_INTERNAL
	case trace.SpanKindServer:
		return tracepb.Span_SPAN_KIND_SERVER
	case trace.SpanKindClient:
		return tracepb.Span_SPAN_KIND_CLIENT
	case trace.SpanKindProducer:
		return tracepb.Span_SPAN_KIND_PRODUCER
	case trace.SpanKindConsumer:
		return tracepb.Span_SPAN_KIND_CONSUMER
	}
	return tracepb.Span_SPAN_KIND_UNSPECIFIED
}

func OTLPStatus(c codes.Code) tracepb.Status_StatusCode {
	switch c {
	case codes.Ok:
		return tracepb.Status_STATUS_CODE_OK
	case codes.Error:
		return tracepb.Status_STATUS_CODE_ERROR
	}
	return tracepb.Status_STATUS_CODE_UNSET
}

// OTLPTime is t in Unix nanoseconds, 0 before 1970.
func OTLPTime(t time.Time) uint64 { return uint64(max(0, t.UnixNano())) }

func Clamp32(n int) uint32 { return uint32(min(max(n, 0), math.MaxUint32)) }

func OTLPIter(it attribute.Iterator) []*commonpb.KeyValue {
	var out []*commonpb.KeyValue
	for it.Next() {
		kv := it.Attribute()
		out = append(out, &commonpb.KeyValue{Key: string(kv.Key), Value: otlpValue(kv.Value)})
	}
	return out
}

func OTLPAttrs(kvs []attribute.KeyValue) []*commonpb.KeyValue {
	var out []*commonpb.KeyValue
	for _, kv := range kvs {
		out = append(out, &commonpb.KeyValue{Key: string(kv.Key), Value: otlpValue(kv.Value)})
	}
	return out
}

// otlpValue is an attribute's value; an empty one is an empty AnyValue.
func otlpValue(v attribute.Value) *commonpb.AnyValue {
	switch v.Type() {
	case attribute.BOOL:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_BoolValue{BoolValue: v.AsBool()}}
	case attribute.INT64:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_IntValue{IntValue: v.AsInt64()}}
	case attribute.FLOAT64:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_DoubleValue{DoubleValue: v.AsFloat64()}}
	case attribute.STRING:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: v.AsString()}}
	case attribute.BYTESLICE:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_BytesValue{BytesValue: v.AsByteSlice()}}
	case attribute.MAP:
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_KvlistValue{KvlistValue: &commonpb.KeyValueList{Values: OTLPAttrs(v.AsMap())}}}
	case attribute.BOOLSLICE:
		return otlpArray(v.AsBoolSlice(), attribute.BoolValue)
	case attribute.INT64SLICE:
		return otlpArray(v.AsInt64Slice(), attribute.Int64Value)
	case attribute.FLOAT64SLICE:
		return otlpArray(v.AsFloat64Slice(), attribute.Float64Value)
	case attribute.STRINGSLICE:
		return otlpArray(v.AsStringSlice(), attribute.StringValue)
	case attribute.SLICE:
		return otlpArray(v.AsSlice(), func(v attribute.Value) attribute.Value { return v })
	case attribute.EMPTY:
		return &commonpb.AnyValue{}
	}
	return &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: "INVALID"}}
}

// otlpArray is an array value of vs, each made a Value by val.
func otlpArray[T any](vs []T, val func(T) attribute.Value) *commonpb.AnyValue {
	out := make([]*commonpb.AnyValue, len(vs))
	for i, v := range vs {
		out[i] = otlpValue(val(v))
	}
	return &commonpb.AnyValue{Value: &commonpb.AnyValue_ArrayValue{ArrayValue: &commonpb.ArrayValue{Values: out}}}
}
