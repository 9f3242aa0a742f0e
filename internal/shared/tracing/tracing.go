// Package tracing is the OpenTelemetry tracing of the API and the gateway:
// the SDK's tracer provider with this project's sampler (sampler.go) and
// OTLP/HTTP exporter (otlp.go, over lite's), and, re-exported from
// internal/shared/tracing/lite, what every process shares: the [tracing]
// configuration, the span names, the W3C trace-context propagator that
// ignores oversized headers, and the HTTP wrappers that start server and
// client spans. bcd uses lite alone, without the SDK.
//
// Trace context carries no authority: nothing reads it but the tracer,
// and it is in no digest or seal (docs/security.md).
package tracing

import (
	"context"
	"net/url"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/tracing/lite"
)

// What lite defines, under the names the API and the gateway use.
const (
	ServiceAPI          = lite.ServiceAPI
	ServiceGateway      = lite.ServiceGateway
	ServiceBCD          = lite.ServiceBCD
	SpanStoreTx         = lite.SpanStoreTx
	SpanSessionOpen     = lite.SpanSessionOpen
	SpanCommand         = lite.SpanCommand
	AttrCommandKind     = lite.AttrCommandKind
	AttrNodeID          = lite.AttrNodeID
	MaxTraceparentBytes = lite.MaxTraceparentBytes
	MaxTracestateBytes  = lite.MaxTracestateBytes
	UnknownSpan         = lite.UnknownSpan
)

type (
	// Config is the [tracing] section every process reads.
	Config = lite.Config
	// HandlerOption changes what Handler does.
	HandlerOption = lite.HandlerOption
)

// The functions lite defines; see there.
var (
	Provider            = lite.Provider
	Propagator          = lite.Propagator
	Start               = lite.Start
	StartOn             = lite.StartOn
	End                 = lite.End
	Handler             = lite.Handler
	StartServer         = lite.StartServer
	StartClient         = lite.StartClient
	EndClient           = lite.EndClient
	Transport           = lite.Transport
	Client              = lite.Client
	TrustCallerSampling = lite.TrustCallerSampling
)

// Setup builds the SDK provider c describes and makes it the global one
// (what Provider(nil) returns). Without an endpoint it is a no-op provider.
// The returned function flushes and stops it.
func Setup(c Config, service string) (trace.TracerProvider, func(context.Context) error, error) {
	if err := c.Validate(); err != nil {
		return nil, nil, err
	}
	if c.OTLPEndpoint == "" {
		tp := noop.NewTracerProvider()
		otel.SetTracerProvider(tp)
		lite.SetProvider(tp)
		return tp, func(context.Context) error { return nil }, nil
	}
	if u, err := url.Parse(c.OTLPEndpoint); err != nil || u.Host == "" {
		return nil, nil, errs.New(errs.InvalidConfig, "tracing.otlp_endpoint: not a URL with a host: %q", c.OTLPEndpoint)
	}
	exp := newOTLPExporter(strings.TrimSuffix(c.OTLPEndpoint, "/") + "/v1/traces")
	tp := NewProvider(c, service, sdktrace.WithBatcher(exp))
	otel.SetTracerProvider(tp)
	lite.SetProvider(tp)
	return tp, tp.Shutdown, nil
}

// NewProvider is the SDK provider c describes, with opts (an exporter).
func NewProvider(c Config, service string, opts ...sdktrace.TracerProviderOption) *sdktrace.TracerProvider {
	if c.ServiceName != "" {
		service = c.ServiceName
	}
	ratio := 1.0
	if c.SampleRatio != nil {
		ratio = *c.SampleRatio
	}
	opts = append([]sdktrace.TracerProviderOption{
		sdktrace.WithSampler(newSampler(ratio)),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))),
	}, opts...)
	return sdktrace.NewTracerProvider(opts...)
}
