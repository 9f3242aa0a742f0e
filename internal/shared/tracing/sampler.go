package tracing

import (
	"context"
	"fmt"
	"math/rand/v2"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// trustedCaller marks a context whose remote parent came from a caller
// the handler trusts (TrustCallerSampling).
type trustedCaller struct{}

// sampler decides which spans are recorded and exported (R23.3).
//
//   - A root span (no parent): the configured ratio of trace ids, which
//     this process generated.
//   - A child of a span of this process: as its parent, so a trace is
//     whole or absent.
//   - A child of a caller's span (a traceparent header): as the caller
//     said only when the handler trusts the caller; otherwise the ratio,
//     drawn at random. SECURITY: the sampled flag and the trace id are the
//     caller's to choose, so neither may decide: honouring the flag let
//     any unauthenticated request be traced and exported with
//     sample_ratio = 0, and a ratio of the trace id would let a caller
//     pick ids that are always sampled.
type sampler struct {
	ratio float64
	root  sdktrace.Sampler
}

func newSampler(ratio float64) sdktrace.Sampler {
	return sampler{ratio: ratio, root: sdktrace.TraceIDRatioBased(ratio)}
}

func (s sampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	psc := trace.SpanContextFromContext(p.ParentContext)
	if !psc.IsValid() {
		return s.root.ShouldSample(p)
	}
	decision := sdktrace.Drop
	switch {
	case !psc.IsRemote() || trusted(p.ParentContext):
		if psc.IsSampled() {
			decision = sdktrace.RecordAndSample
		}
	case s.ratio >= 1 || (s.ratio > 0 && rand.Float64() < s.ratio):
		decision = sdktrace.RecordAndSample
	}
	return sdktrace.SamplingResult{Decision: decision, Tracestate: psc.TraceState()}
}

func (s sampler) Description() string {
	return fmt.Sprintf("BetterComputeSampler{ratio=%g, caller's flag only when trusted}", s.ratio)
}

func trusted(ctx context.Context) bool {
	v, _ := ctx.Value(trustedCaller{}).(bool)
	return v
}
