package tracing

import (
	"fmt"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/internal/shared/tracing/lite"
)

// sampler decides which spans are recorded and exported (R23.3): as
// lite.Sampled, which says how and why.
type sampler struct {
	ratio float64
}

func newSampler(ratio float64) sdktrace.Sampler { return sampler{ratio: ratio} }

// ShouldSample is lite.Sampled, which bcd's provider uses too.
func (s sampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	decision := sdktrace.Drop
	if lite.Sampled(p.ParentContext, p.TraceID, s.ratio) {
		decision = sdktrace.RecordAndSample
	}
	return sdktrace.SamplingResult{Decision: decision, Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
}

func (s sampler) Description() string {
	return fmt.Sprintf("BetterComputeSampler{ratio=%g, caller's flag only when trusted}", s.ratio)
}
