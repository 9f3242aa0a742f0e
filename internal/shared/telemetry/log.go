package telemetry

import (
	"context"
	"io"
	"log/slog"

	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Log formats (log.format).
const (
	FormatText = "text"
	FormatJSON = "json"
)

// LogConfig is the [log] section every process reads.
type LogConfig struct {
	// Format is "text" (the default, logfmt) or "json" (one object a line).
	Format string `toml:"format"`
	// Level is debug, info (the default), warn or error.
	Level string `toml:"level"`
}

// NewLogger returns the logger c describes, writing to w. A line logged
// with a context that holds a span (a traced request's) carries its
// trace_id and span_id (LogTraceID, LogSpanID), so an operator goes from a
// log line to its trace.
func NewLogger(w io.Writer, c LogConfig) (*slog.Logger, error) {
	var level slog.Level
	if c.Level != "" {
		if err := level.UnmarshalText([]byte(c.Level)); err != nil {
			return nil, errs.New(errs.InvalidConfig, "log.level: want debug, info, warn or error, not %q", c.Level)
		}
	}
	opts := &slog.HandlerOptions{Level: level}
	switch c.Format {
	case "", FormatText:
		return slog.New(Traced(slog.NewTextHandler(w, opts))), nil
	case FormatJSON:
		return slog.New(Traced(slog.NewJSONHandler(w, opts))), nil
	}
	return nil, errs.New(errs.InvalidConfig, "log.format: want text or json, not %q", c.Format)
}

// Traced wraps h so that a record logged with a context holding a valid
// span context gets LogTraceID and LogSpanID attributes. A record without
// one is passed through unchanged, at no cost.
func Traced(h slog.Handler) slog.Handler { return traced{h} }

type traced struct{ slog.Handler }

func (h traced) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String(LogTraceID, sc.TraceID().String()), slog.String(LogSpanID, sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traced) WithAttrs(as []slog.Attr) slog.Handler { return traced{h.Handler.WithAttrs(as)} }

func (h traced) WithGroup(name string) slog.Handler { return traced{h.Handler.WithGroup(name)} }
