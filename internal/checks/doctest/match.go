package doctest

import (
	"fmt"
	"regexp"
	"strings"
)

// Ellipsis in a doc's output stands for what was left out: alone on a line
// any number of lines, inside a line any text.
const Ellipsis = "…"

// Normaliser rewrites what differs between runs to stable placeholders.
// Replace pairs run first, in order, on both sides (the test's temp
// directory and the doc's, for example); then the built-in rules.
type Normaliser struct {
	Replace []Replacement
}

// Replacement is one literal rewrite applied before the built-in rules.
type Replacement struct{ Old, New string }

var rules = []struct {
	re  *regexp.Regexp
	new string
}{
	{regexp.MustCompile(`\b(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?|\d{8}T\d{6}Z)`), "TIME"},
	{regexp.MustCompile(`sha256/[A-Za-z0-9+/]{43}=`), "sha256/PIN"},
	{regexp.MustCompile(`\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`), "UUID"},
	{regexp.MustCompile(`\b([0-9a-f]{2}:){5}[0-9a-f]{2}\b`), "MAC"},
	// Ids: a short lowercase prefix, an underscore and a long suffix
	// (node_01m8…, jt_…, ev_HtVV… cursors, bck_… keys).
	{regexp.MustCompile(`\b([a-z]{2,5})_[0-9A-Za-z_-]{10,}`), "${1}_ID"},
	{regexp.MustCompile(`\b[0-9a-f]{8,}\b`), "HEX"},
	{regexp.MustCompile(`\b127\.0\.0\.1:\d+\b`), "127.0.0.1:PORT"},
	{regexp.MustCompile(`\b(\d+h)?(\d+m)?\d+(\.\d+)?(ms|s)\b`), "DUR"},
	{regexp.MustCompile(`\b(\d+h)?\d+m\b`), "DUR"},
}

// Lines normalises text into the lines a comparison sees: placeholders
// for what varies, runs of blanks collapsed (table columns are as wide as
// their values), blank lines dropped.
func (n Normaliser) Lines(text string) []string {
	for _, r := range n.Replace {
		text = strings.ReplaceAll(text, r.Old, r.New)
	}
	for _, r := range rules {
		text = r.re.ReplaceAllString(text, r.new)
	}
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if l = strings.Join(strings.Fields(l), " "); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// Match reports whether got (what printed) matches want (the doc's output
// block), both normalised by n, and when not a message showing both.
func (n Normaliser) Match(want, got string) (bool, string) {
	w, g := n.Lines(want), n.Lines(got)
	pats := make([]*regexp.Regexp, len(w))
	for i, l := range w {
		if l == Ellipsis {
			continue
		}
		parts := strings.Split(l, Ellipsis)
		for j := range parts {
			parts[j] = regexp.QuoteMeta(parts[j])
		}
		pats[i] = regexp.MustCompile("^" + strings.Join(parts, ".*") + "$")
	}
	if matchLines(pats, g, map[[2]int]bool{}, 0, 0) {
		return true, ""
	}
	return false, fmt.Sprintf("the doc shows (normalised):\n\t%s\nbut this printed (normalised):\n\t%s\nfirst doc line not found in order: %s",
		strings.Join(w, "\n\t"), strings.Join(g, "\n\t"), firstMissing(pats, w, g))
}

// matchLines matches pattern lines from i against got lines from j; a nil
// pattern (an ellipsis line) takes any number of lines.
func matchLines(pats []*regexp.Regexp, got []string, seen map[[2]int]bool, i, j int) bool {
	if i == len(pats) {
		return j == len(got)
	}
	if seen[[2]int{i, j}] {
		return false
	}
	seen[[2]int{i, j}] = true
	if pats[i] == nil {
		for k := j; k <= len(got); k++ {
			if matchLines(pats, got, seen, i+1, k) {
				return true
			}
		}
		return false
	}
	return j < len(got) && pats[i].MatchString(got[j]) && matchLines(pats, got, seen, i+1, j+1)
}

// firstMissing names the first doc line with no printed line to match it
// after the previous ones: the likeliest place the doc went stale.
func firstMissing(pats []*regexp.Regexp, w, g []string) string {
	j := 0
	for i, p := range pats {
		if p == nil {
			continue
		}
		for j < len(g) && !p.MatchString(g[j]) {
			j++
		}
		if j == len(g) {
			return fmt.Sprintf("%q", w[i])
		}
		j++
	}
	return "(all found; the lines between differ, or there are more lines than the doc shows without a …)"
}
