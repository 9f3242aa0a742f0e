// Package lite is the tracing every process shares that needs no
// OpenTelemetry SDK: the [tracing] configuration, the span names, the W3C
// trace-context propagator that ignores oversized headers, the HTTP
// wrappers that start server and client spans, the OTLP/HTTP exporter
// (otlp.go), and bcd's tracer provider (provider.go), which feeds that
// exporter. The API and the gateway use the SDK's provider
// (internal/shared/tracing, which re-exports this package); bcd, which
// runs on every machine, links only this one and the OpenTelemetry API.
//
// Trace context carries no authority: nothing reads it but the tracer,
// and it is in no digest or seal (docs/security.md).
package lite

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Default service names (tracing.service_name).
const (
	ServiceAPI     = "better-compute-api"
	ServiceGateway = "better-compute-gateway"
	ServiceBCD     = "bcd"
)

// Span names that are not an RPC procedure.
const (
	// SpanStoreTx is a database transaction (store.DB.WithTx).
	SpanStoreTx = "store.tx"
	// SpanSessionOpen is bcd opening a session, from its dial to the
	// Welcome: the root of the session's trace, whose context goes to the
	// gateway and on to the API with the stream.
	SpanSessionOpen = "bcd.session.open"
	// SpanCommand is bcd handling one signed command (verify, run), a
	// child of its session's SpanSessionOpen.
	SpanCommand = "bcd.command"
)

// Span attributes of bcd's spans.
const (
	// AttrCommandKind is a command's kind (a signed command's: the API
	// chose it from the fixed set).
	AttrCommandKind = "bc.command.kind"
	// AttrNodeID is the node a bcd span is of.
	AttrNodeID = "bc.node.id"
)

// Header size caps: a traceparent is 55 bytes (version 00); a tracestate
// holds at most 32 entries. Larger headers are ignored, never parsed or
// logged.
const (
	MaxTraceparentBytes = 128
	MaxTracestateBytes  = 512
)

// Instrumentation is the tracer's name.
const Instrumentation = "github.com/better-compute/better-compute"

// Config is the [tracing] section every process reads.
type Config struct {
	// OTLPEndpoint is the OTLP/HTTP collector's base URL
	// ("http://127.0.0.1:4318"); empty (the default) turns tracing off.
	OTLPEndpoint string `toml:"otlp_endpoint,omitempty"`
	// SampleRatio is the share of new traces sampled, 0 to 1 (default 1).
	// A caller's traceparent does not decide it (its sampled flag is
	// ignored) unless the handler trusts the caller (TrustCallerSampling).
	SampleRatio *float64 `toml:"sample_ratio,omitempty"`
	// ServiceName names the process in traces (default: the process's).
	ServiceName string `toml:"service_name,omitempty"`
}

// Validate checks c; errors are INVALID_CONFIG naming the key.
func (c Config) Validate() error {
	if c.SampleRatio != nil && (*c.SampleRatio < 0 || *c.SampleRatio > 1) {
		return errs.New(errs.InvalidConfig, "tracing.sample_ratio: want 0 to 1, not %v", *c.SampleRatio)
	}
	if c.OTLPEndpoint != "" && !strings.HasPrefix(c.OTLPEndpoint, "http://") && !strings.HasPrefix(c.OTLPEndpoint, "https://") {
		return errs.New(errs.InvalidConfig, "tracing.otlp_endpoint: want an http:// or https:// URL, not %q", c.OTLPEndpoint)
	}
	return nil
}

// global is the provider Provider(nil) returns.
var global atomic.Pointer[trace.TracerProvider]

// SetProvider makes tp the global provider (what Provider(nil) returns).
func SetProvider(tp trace.TracerProvider) { global.Store(&tp) }

// Provider returns tp, or the global provider when tp is nil (a no-op
// unless Setup configured one).
func Provider(tp trace.TracerProvider) trace.TracerProvider {
	if tp != nil {
		return tp
	}
	if g := global.Load(); g != nil {
		return *g
	}
	return noop.NewTracerProvider()
}

// Propagator is W3C trace context, ignoring oversized headers.
var Propagator propagation.TextMapPropagator = capped{propagation.TraceContext{}}

type capped struct{ propagation.TraceContext }

// Extract ignores a carrier whose headers exceed the caps.
func (c capped) Extract(ctx context.Context, carrier propagation.TextMapCarrier) context.Context {
	if len(carrier.Get("traceparent")) > MaxTraceparentBytes || len(carrier.Get("tracestate")) > MaxTracestateBytes {
		return ctx
	}
	return c.TraceContext.Extract(ctx, carrier)
}

// Start starts a span named name, a child of ctx's span, on the provider
// of ctx's span. A call not recorded (tracing off, or not sampled) gets
// ctx back and a no-op span, at no cost.
func Start(ctx context.Context, name string) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, noopSpan
	}
	return parent.TracerProvider().Tracer(Instrumentation).Start(ctx, name)
}

// StartOn starts a span named name on tp (nil: the global provider), a
// child of ctx's span context (a new trace without one). Unlike Start it
// records even when ctx's span is not recording (a root span, or the child
// of a span that ended). A no-op provider gives a no-op span.
func StartOn(ctx context.Context, tp trace.TracerProvider, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	return Provider(tp).Tracer(Instrumentation).Start(ctx, name, opts...)
}

// noopSpan is the span of no context: ending it does nothing.
var noopSpan = trace.SpanFromContext(context.Background())

// End records err (if any) on span and ends it.
func End(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, string(errs.CodeOf(err)))
	}
	span.End()
}

// UnknownSpan names the server span of a request whose path looks like an
// RPC procedure this process does not know.
const UnknownSpan = "unknown"

// clientSpanName is an RPC's procedure without its leading slash
// ("bc.agent.v1.JoinService/Join"), else "HTTP {method}": paths other
// than procedures would make span names unbounded. It names client
// spans, whose paths this process chose.
func clientSpanName(method, path string) string {
	p := strings.TrimPrefix(path, "/")
	if svc, m, ok := strings.Cut(p, "/"); ok && m != "" && !strings.Contains(m, "/") && strings.Contains(svc, ".") && !strings.ContainsAny(p, "?%") && len(p) <= 128 {
		return p
	}
	return "HTTP " + method
}

// serverSpanName names a server span from what this process knows, never
// from what the caller wrote (R23.3): a procedure of a service compiled
// into it (the protobuf registry: "bettercompute.v1.NodeService/GetNode",
// under a base path or not), UnknownSpan for any other path shaped like a
// procedure (a dotted service ending in a capitalised name, then a
// method), "HTTP {method}" for other paths with a standard method, and
// UnknownSpan for any other method.
func serverSpanName(method, p string) string {
	if i := strings.LastIndex(p, "/"); i > 0 {
		j := strings.LastIndex(p[:i], "/")
		svc, method := p[j+1:i], p[i+1:]
		if k := strings.LastIndex(svc, "."); k >= 0 && k+1 < len(svc) && svc[k+1] >= 'A' && svc[k+1] <= 'Z' && method != "" {
			return knownProcedure(svc, method)
		}
	}
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions:
		return "HTTP " + method
	}
	return UnknownSpan
}

// knownProcedure is "service/method" as the registry spells it, or
// UnknownSpan.
func knownProcedure(service, method string) string {
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return UnknownSpan
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return UnknownSpan
	}
	md := sd.Methods().ByName(protoreflect.Name(method))
	if md == nil {
		return UnknownSpan
	}
	return string(sd.FullName()) + "/" + string(md.Name())
}

// trustedCaller marks a context whose remote parent came from a caller
// the handler trusts (TrustCallerSampling).
type trustedCaller struct{}

// TrustedCaller reports whether ctx's remote parent came from a caller the
// handler trusts (TrustCallerSampling): then a sampler follows its flag.
func TrustedCaller(ctx context.Context) bool {
	v, _ := ctx.Value(trustedCaller{}).(bool)
	return v
}

// HandlerOption changes what Handler does.
type HandlerOption func(*handlerOptions)

type handlerOptions struct{ trust bool }

// TrustCallerSampling makes a server span follow its caller's sampled
// flag: only for a handler whose every caller is authenticated before it
// (the agent listener's gateways, with their client certificate, or the
// gateway in this process). Elsewhere the caller's flag is ignored.
func TrustCallerSampling() HandlerOption { return func(o *handlerOptions) { o.trust = true } }

// Handler serves next with a server span per request, a child of the
// caller's trace context (the traceparent header) when it has one. Whether
// it is sampled is this process's decision (the configured ratio) unless
// TrustCallerSampling; its name comes from serverSpanName. tp nil: the
// global provider.
func Handler(tp trace.TracerProvider, next http.Handler, opts ...HandlerOption) http.Handler {
	tp = Provider(tp)
	if _, off := tp.(noop.TracerProvider); off {
		return next
	}
	var o handlerOptions
	for _, opt := range opts {
		opt(&o)
	}
	tr := tp.Tracer(Instrumentation)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := startServer(r.Context(), tr, r.Method, r.URL.Path, r.Header, o)
		defer span.End()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// StartServer starts the server span Handler starts for a request of
// method to path whose headers are header (their traceparent), for a
// server that is no http.Handler (a stream served on h2server's
// callbacks): the same name, attributes, parent and sampling. The caller
// ends the span when its answer is done. A no-op provider (tp nil: the
// global one) gives ctx back and a no-op span, at no cost.
func StartServer(ctx context.Context, tp trace.TracerProvider, method, path string, header http.Header, opts ...HandlerOption) (context.Context, trace.Span) {
	tp = Provider(tp)
	if _, off := tp.(noop.TracerProvider); off {
		return ctx, noopSpan
	}
	var o handlerOptions
	for _, opt := range opts {
		opt(&o)
	}
	return startServer(ctx, tp.Tracer(Instrumentation), method, path, header, o)
}

// startServer is Handler's span, on tr.
func startServer(ctx context.Context, tr trace.Tracer, method, path string, header http.Header, o handlerOptions) (context.Context, trace.Span) {
	ctx = Propagator.Extract(ctx, propagation.HeaderCarrier(header))
	if o.trust {
		ctx = context.WithValue(ctx, trustedCaller{}, true)
	}
	name := serverSpanName(method, path)
	return tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("rpc.method", name)))
}

// Transport wraps base (nil: http.DefaultTransport) with a client span per
// request, whose context it sends as traceparent. tp nil: the global
// provider.
func Transport(tp trace.TracerProvider, base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	tp = Provider(tp)
	if _, off := tp.(noop.TracerProvider); off {
		return base
	}
	return &transport{tr: tp.Tracer(Instrumentation), base: base}
}

type transport struct {
	tr   trace.Tracer
	base http.RoundTripper
}

func (t *transport) RoundTrip(r *http.Request) (*http.Response, error) {
	ctx, span := t.tr.Start(r.Context(), clientSpanName(r.Method, r.URL.Path), trace.WithSpanKind(trace.SpanKindClient))
	r = r.Clone(ctx)
	Propagator.Inject(ctx, propagation.HeaderCarrier(r.Header))
	res, err := t.base.RoundTrip(r)
	if err != nil {
		EndClient(span, 0)
		return nil, err
	}
	// A streaming call's span ends with its response headers: the span
	// measures the call's start, not a session's life.
	EndClient(span, res.StatusCode)
	return res, nil
}

// StartClient starts the client span Transport starts for a request of
// method to path, a child of ctx's span, and sets its context in header
// (traceparent), for a client that is no http.RoundTripper (a stream
// opened on h2upstream). The caller ends it with EndClient once the
// response's headers came, or the request failed. A no-op provider (tp
// nil: the global one) gives a no-op span and leaves header as it is.
func StartClient(ctx context.Context, tp trace.TracerProvider, method, path string, header http.Header) trace.Span {
	tp = Provider(tp)
	if _, off := tp.(noop.TracerProvider); off {
		return noopSpan
	}
	ctx, span := tp.Tracer(Instrumentation).Start(ctx, clientSpanName(method, path), trace.WithSpanKind(trace.SpanKindClient))
	Propagator.Inject(ctx, propagation.HeaderCarrier(header))
	return span
}

// EndClient ends a client span as Transport does: with the response's
// HTTP status, or, status 0 (no response), as a transport failure.
func EndClient(span trace.Span, status int) {
	switch {
	case !span.IsRecording():
	case status == 0:
		span.SetStatus(codes.Error, "transport")
	default:
		span.SetAttributes(attribute.Int("http.response.status_code", status))
	}
	span.End()
}

// CloseIdleConnections passes through to base.
func (t *transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// Client wraps c's transport (c is modified and returned).
func Client(tp trace.TracerProvider, c *http.Client) *http.Client {
	c.Transport = Transport(tp, c.Transport)
	return c
}
