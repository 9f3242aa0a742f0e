package telemetry

import (
	"io"
	"log/slog"

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

// NewLogger returns the logger c describes, writing to w.
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
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case FormatJSON:
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, errs.New(errs.InvalidConfig, "log.format: want text or json, not %q", c.Format)
}
