// Package telemetrytest reads metrics back in tests: from a registry
// (Gather) or from a /metrics endpoint (Scrape), as one value per series,
// so a test asserts how much a series moved.
package telemetrytest

import (
	"io"
	"net/http"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Values are series values by Key: the name, then the labels sorted,
// `bc_joins_total{attestor="join-token",outcome="admitted"}`. A histogram
// is its count (name_count) and a summary likewise.
type Values map[string]float64

// Get returns the value of name with labels ("k", "v", ...); a label left
// out matches any, summed over the series that match. 0 when none does.
func (v Values) Get(name string, labels ...string) float64 {
	var sum float64
	for k, x := range v {
		if k != name && !strings.HasPrefix(k, name+"{") {
			continue
		}
		ok := true
		for i := 0; i+1 < len(labels); i += 2 {
			if !strings.Contains(k, labels[i]+`="`+labels[i+1]+`"`) {
				ok = false
				break
			}
		}
		if ok {
			sum += x
		}
	}
	return sum
}

// Gather reads every series of g.
func Gather(t testing.TB, g prometheus.Gatherer) Values {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	return values(mfs)
}

// Scrape reads every series from a /metrics URL.
func Scrape(t testing.TB, c *http.Client, url string) Values {
	t.Helper()
	if c == nil {
		c = http.DefaultClient
	}
	res, err := c.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s: %s", url, res.Status, b)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(b)))
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	mfs := make([]*dto.MetricFamily, 0, len(fams))
	for _, f := range fams {
		mfs = append(mfs, f)
	}
	return values(mfs)
}

func values(mfs []*dto.MetricFamily) Values {
	out := Values{}
	for _, f := range mfs {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			var v float64
			switch {
			case m.Counter != nil:
				v = m.Counter.GetValue()
			case m.Gauge != nil:
				v = m.Gauge.GetValue()
			case m.Histogram != nil:
				name, v = name+"_count", float64(m.Histogram.GetSampleCount())
			case m.Summary != nil:
				name, v = name+"_count", float64(m.Summary.GetSampleCount())
			case m.Untyped != nil:
				v = m.Untyped.GetValue()
			}
			out[key(name, m.GetLabel())] = v
		}
	}
	return out
}

func key(name string, labels []*dto.LabelPair) string {
	if len(labels) == 0 {
		return name
	}
	parts := make([]string, 0, len(labels))
	for _, l := range labels {
		parts = append(parts, l.GetName()+`="`+l.GetValue()+`"`)
	}
	sort.Strings(parts)
	return name + "{" + strings.Join(parts, ",") + "}"
}
