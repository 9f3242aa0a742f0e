package telemetry

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace"
)

// R17.1: label values come from fixed sets: anything else is "other".
func TestLabelsBoundedR17_1(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{Reason("token-unknown"), "token-unknown"},
		{Reason("seal-expired"), "seal-expired"},
		{Reason("/../whatever the caller sent"), ReasonOther},
		{Attestor("tpm"), "tpm"},
		{Attestor("evil"), ReasonOther},
		{Role("node"), "node"},
		{Role("admin"), ReasonOther},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

// R17.3: log.format json writes one object a line; text is the default;
// anything else is a config error.
func TestNewLoggerR17_3(t *testing.T) {
	var b bytes.Buffer
	log, err := NewLogger(&b, LogConfig{Format: FormatJSON, Level: "debug"})
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("joined", LogNodeID, "node_1")
	var line map[string]any
	if err := json.Unmarshal(b.Bytes(), &line); err != nil || line[LogNodeID] != "node_1" {
		t.Errorf("json line %q: %v", b.String(), err)
	}
	b.Reset()
	log, _ = NewLogger(&b, LogConfig{})
	log.Info("x", LogTenant, "t")
	if got := b.String(); !bytes.Contains([]byte(got), []byte("tenant=t")) {
		t.Errorf("text line %q", got)
	}
	if _, err := NewLogger(&b, LogConfig{Format: "xml"}); err == nil {
		t.Error("format xml accepted")
	}
	if _, err := NewLogger(&b, LogConfig{Level: "loud"}); err == nil {
		t.Error("level loud accepted")
	}
}

// R17.3: a line logged within a traced request carries its trace and span
// ids, in both formats; a line without a span carries neither.
func TestLogTraceIDR17_3(t *testing.T) {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	for _, format := range []string{FormatJSON, FormatText} {
		var b bytes.Buffer
		log, err := NewLogger(&b, LogConfig{Format: format})
		if err != nil {
			t.Fatal(err)
		}
		log = log.With(LogNodeID, "node_1")
		log.InfoContext(ctx, "traced", LogReason, "x")
		log.Info("untraced")
		lines := strings.Split(strings.TrimSpace(b.String()), "\n")
		if len(lines) != 2 {
			t.Fatalf("%s: %d lines: %q", format, len(lines), b.String())
		}
		for _, want := range []string{LogTraceID, tid.String(), LogSpanID, sid.String(), "node_1"} {
			if !strings.Contains(lines[0], want) {
				t.Errorf("%s: traced line %q lacks %q", format, lines[0], want)
			}
		}
		if strings.Contains(lines[1], LogTraceID) || strings.Contains(lines[1], LogSpanID) {
			t.Errorf("%s: untraced line %q has a trace id", format, lines[1])
		}
		if format == FormatJSON {
			var line map[string]any
			if err := json.Unmarshal([]byte(lines[0]), &line); err != nil || line[LogTraceID] != tid.String() || line[LogSpanID] != sid.String() {
				t.Errorf("json line %q: %v", lines[0], err)
			}
		}
	}
}
