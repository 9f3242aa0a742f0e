package run_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/tracing/tracingtest"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// span returns p's span named name of kind under parent, polling until
// there is one (a stream's server span ends when its handler returns).
func span(t *testing.T, p tracingtest.Process, name string, kind trace.SpanKind, parent trace.SpanID) tracetest.SpanStub {
	t.Helper()
	var found tracetest.SpanStub
	eventually(t, name+" span under "+parent.String(), func() bool {
		for _, s := range p.Exp.GetSpans() {
			if s.Name == name && s.SpanKind == kind && s.Parent.SpanID() == parent {
				found = s
				return true
			}
		}
		return false
	})
	return found
}

// attr is s's attribute key as a string ("" without one).
func attr(s tracetest.SpanStub, key string) string {
	for _, a := range s.Attributes {
		if string(a.Key) == key {
			return a.Value.Emit()
		}
	}
	return ""
}

// jsonLine returns the JSON log line of b whose msg is msg.
func jsonLine(t *testing.T, b *syncBuffer, msg string) map[string]any {
	t.Helper()
	for _, l := range strings.Split(b.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg {
			return m
		}
	}
	t.Fatalf("no log line %q in %s", msg, b.String())
	return nil
}

// R17.3: a session is one trace from bcd to the database: bcd's open span
// is the root, its client span the parent of the gateway's server span,
// whose upstream client span is the parent of the API's server span, under
// which the session's transactions run. A command the session delivers is
// handled in a span under the session's open, and bcd's lines for the
// open and the command carry their trace and span ids.
func TestSessionIsOneTraceR17_3(t *testing.T) {
	onStacks(t, stacks, testSessionIsOneTrace)
}

func testSessionIsOneTrace(t *testing.T, st stack) {
	bcd, gw, api := tracingtest.New(t, tracing.ServiceBCD), tracingtest.New(t, tracing.ServiceGateway), tracingtest.New(t, tracing.ServiceAPI)
	c := clock.NewFake(time.Now())
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{Clock: c, Tracer: api.TP})
	h := newHarness(t, e, c, st)
	m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 40, 6)

	h.gwTracer, h.bcdTracer = gw.TP, bcd.TP
	var logs syncBuffer
	log, err := telemetry.NewLogger(&logs, telemetry.LogConfig{Format: telemetry.FormatJSON})
	if err != nil {
		t.Fatal(err)
	}
	h.bcdLog = log
	gwAddr, _ := h.startGateway(t, h.agentURL)
	p := h.startVia(t, m, "https://"+gwAddr)
	h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })
	if c := h.waitCommand(t, h.enqueue(t, m.nodeID)); c.State != store.CommandDone {
		t.Fatalf("command %s: %q", c.State, c.Error)
	}
	p.stop(t) // the stream's server spans end with the session

	const connect = "bettercompute.agent.v1.SessionService/Connect"
	open := span(t, bcd, tracing.SpanSessionOpen, trace.SpanKindInternal, trace.SpanID{})
	bcdClient := span(t, bcd, connect, trace.SpanKindClient, open.SpanContext.SpanID())
	gwServer := span(t, gw, connect, trace.SpanKindServer, bcdClient.SpanContext.SpanID())
	gwClient := span(t, gw, connect, trace.SpanKindClient, gwServer.SpanContext.SpanID())
	apiServer := span(t, api, connect, trace.SpanKindServer, gwClient.SpanContext.SpanID())
	tx := span(t, api, tracing.SpanStoreTx, trace.SpanKindInternal, apiServer.SpanContext.SpanID())
	cmd := span(t, bcd, tracing.SpanCommand, trace.SpanKindInternal, open.SpanContext.SpanID())
	tid := open.SpanContext.TraceID()
	for _, s := range []tracetest.SpanStub{bcdClient, gwServer, gwClient, apiServer, tx, cmd} {
		if s.SpanContext.TraceID() != tid {
			t.Errorf("%s (%v): trace %s, want the session's %s", s.Name, s.SpanKind, s.SpanContext.TraceID(), tid)
		}
	}
	// Every stack's spans say the same: the relay and the API on
	// callbacks as on net/http.
	for _, c := range []struct {
		s         tracetest.SpanStub
		key, want string
	}{
		{gwServer, "rpc.method", connect},
		{apiServer, "rpc.method", connect},
		{gwClient, "http.response.status_code", "200"},
	} {
		if got := attr(c.s, c.key); got != c.want {
			t.Errorf("%s (%v): %s %q, want %q", c.s.Name, c.s.SpanKind, c.key, got, c.want)
		}
	}
	if kind := attr(cmd, tracing.AttrCommandKind); kind != wire.KindNodeFacts {
		t.Errorf("command span kind %q, want %q", kind, wire.KindNodeFacts)
	}
	for msg, span := range map[string]tracetest.SpanStub{"session open": open, "command done": cmd} {
		l := jsonLine(t, &logs, msg)
		if l[telemetry.LogTraceID] != tid.String() || l[telemetry.LogSpanID] != span.SpanContext.SpanID().String() {
			t.Errorf("%q line %v: want trace %s span %s", msg, l, tid, span.SpanContext.SpanID())
		}
	}
}
