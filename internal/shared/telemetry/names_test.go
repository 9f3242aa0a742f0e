package telemetry

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

var metricName = regexp.MustCompile(`bc_[a-z_]+`)

// R17.1: the dashboard uses only metrics defined here, and the operator
// docs' metric tables (docs/operations/observability.md) name every one of
// them.
func TestDashboardAndDocsR17_1(t *testing.T) {
	src, err := os.ReadFile("names.go")
	if err != nil {
		t.Fatal(err)
	}
	defined := map[string]bool{}
	for _, m := range regexp.MustCompile(`"(bc_[a-z_]+)"`).FindAllStringSubmatch(string(src), -1) {
		defined[m[1]] = true
	}
	dash, err := os.ReadFile("../../../deploy/grafana/better-compute.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range metricName.FindAllString(string(dash), -1) {
		base := strings.TrimSuffix(n, "_bucket")
		if !defined[base] {
			t.Errorf("the dashboard uses %s, which names.go does not define", n)
		}
	}
	docs, err := os.ReadFile("../../../docs/operations/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	for n := range defined {
		if !strings.Contains(string(docs), "`"+n+"`") {
			t.Errorf("docs/operations/observability.md does not name %s", n)
		}
	}
}
