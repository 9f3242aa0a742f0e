// Package tracingtest records a process's spans in memory, for tests that
// follow one trace across several processes (each with its own provider,
// as in production). Importers: tests only.
package tracingtest

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// Process is one process's tracer provider and the spans it ended.
type Process struct {
	TP  *sdktrace.TracerProvider
	Exp *tracetest.InMemoryExporter
}

// New is a process named service whose spans are exported at once (a
// span is in Exp when End returns); it is shut down when t ends.
func New(t testing.TB, service string) Process {
	exp := tracetest.NewInMemoryExporter()
	tp := tracing.NewProvider(tracing.Config{}, service, sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return Process{TP: tp, Exp: exp}
}
