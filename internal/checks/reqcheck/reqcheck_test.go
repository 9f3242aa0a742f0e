package reqcheck

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// scanned are the trees whose Go files may cite requirements.
var scanned = []string{"cmd", "internal", "e2e", "deploy"}

// self is this package, whose tests cite made-up numbers on purpose.
const self = "internal/checks/reqcheck"

func TestExtract(t *testing.T) {
	for _, tc := range []struct {
		line string
		want []Ref
	}{
		{"// R4.9: a retried join gets the stored answer", []Ref{"R4.9"}},
		{"// (R6.1), R6.2; see R13.3/R13.4.", []Ref{"R6.1", "R6.2", "R13.3", "R13.4"}},
		{`t.Errorf("R1.2: got %v", err)`, []Ref{"R1.2"}},
		{`{name: "x", req: "R15.1"},`, []Ref{"R15.1"}},
		{"// Package join (R4, R11.2–R11.4)", []Ref{"R4", "R11.2", "R11.4"}},
		{"// R10.1–R10.3 with real processes", []Ref{"R10.1", "R10.3"}},
		{"// R4.5/R12.2", []Ref{"R4.5", "R12.2"}},
		{"// R4.9a, the retry", []Ref{"R4.9a"}},
		{"// ends a sentence with R12.", []Ref{"R12"}},
		{"R3.6", []Ref{"R3.6"}},
		{"func TestJoinRetriesLostAnswerR4_9(t *testing.T) {", []Ref{"R4.9"}},
		{"func TestR12_1SessionRefused(t *testing.T) {", []Ref{"R12.1"}},
		{"func TestR12_3ReplayedCommandRefused(t *testing.T) {", []Ref{"R12.3"}},
		{"var casesR10_5_x509pop = 1", []Ref{"R10.5"}},
		{"R4_9", []Ref{"R4.9"}},
		{"// undefined ones are still extracted: R99.1 and R21", []Ref{"R99.1", "R21"}},

		// Not citations.
		{"// ECDH-ES+A256KW per RFC 7518, RFC7516", nil},
		{"placeholderHardwareR62 bool", nil},
		{"cipher AES256R2 and PR12 and xR4.9", nil},
		{"R2D2 and R4s and R4.9ab", nil},
		{"bcd 0R1_2 is no identifier cite", nil},
		{"// version R1.2.3 of the tool", nil},
		{`pem := "MIIBkTCB+R12/aGVsbG8gd29ybGQ="`, nil},
		{"0x7R4, r4.9, R, R.9, R_9", nil},
	} {
		if got := Extract(tc.line); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Extract(%q) = %q, want %q", tc.line, got, tc.want)
		}
	}
}

func TestRefAnchor(t *testing.T) {
	for ref, want := range map[Ref]string{"R4.9": "r4-9", "R10": "r10", "R4.9a": "r4-9a", "R15.1": "r15-1"} {
		if got := ref.Anchor(); got != want {
			t.Errorf("%s.Anchor() = %q, want %q", ref, got, want)
		}
	}
	if got := Ref("R15.1").Section(); got != "R15" {
		t.Errorf("Section = %q", got)
	}
}

const sampleMD = `# Requirements

## <a id="r4"></a>R4 The join flow

- <a id="r4-2"></a>**R4.2** The token travels sealed.
- <a id="r4-9"></a>**R4.9** A retried join gets the stored answer.

## <a id="r12"></a>R12 Sessions

- <a id="r12-1"></a>**R12.1** bcd holds a session.
`

func TestParseAnchors(t *testing.T) {
	defined, err := ParseAnchors(sampleMD)
	if err != nil {
		t.Fatal(err)
	}
	want := []Ref{"R12", "R12.1", "R4", "R4.2", "R4.9"}
	var got []Ref
	for ref := range defined {
		got = append(got, ref)
	}
	sort.Slice(got, func(i, j int) bool { return got[i] < got[j] })
	if !reflect.DeepEqual(got, want) {
		t.Errorf("defined = %q, want %q", got, want)
	}

	for name, tc := range map[string]struct{ md, problem string }{
		"bad id":        {sampleMD + `- <a id="R4.10"></a>**R4.10** x`, `anchor "R4.10" is not r<n>`},
		"duplicate":     {sampleMD + `- <a id="r4-9"></a>**R4.9** again`, "second anchor for R4.9"},
		"no section":    {sampleMD + `- <a id="r7-1"></a>**R7.1** orphan`, `R7.1 has no section anchor "r7"`},
		"wrong label":   {sampleMD + `- <a id="r4-3"></a>**R4.4** renumbered`, `anchor "r4-3" is not followed by R4.3`},
		"longer label":  {sampleMD + `- <a id="r4-1"></a>**R4.10** renumbered`, `anchor "r4-1" is not followed by R4.1`},
		"section label": {sampleMD + `## <a id="r5"></a>R6 Expect`, `anchor "r5" is not followed by R5`},
		"no anchor":     {sampleMD + "- **R12.2** controllers", `R12.2 has no anchor "r12-2"`},
		"section bare":  {sampleMD + "## R13 Renewal", `R13 has no anchor "r13"`},
	} {
		_, err := ParseAnchors(tc.md)
		if err == nil || !strings.Contains(err.Error(), tc.problem) {
			t.Errorf("%s: err = %v, want one containing %q", name, err, tc.problem)
		}
	}
}

// TestRemovedAnchorIsDetected checks the whole chain on samples: a citation
// of a defined number passes, and deleting that number's anchor makes the
// same citation undefined.
func TestRemovedAnchorIsDetected(t *testing.T) {
	code := "// R4.9: the stored answer (R4, R12)\nfunc TestRetryR4_9(t *testing.T) {}\n// R12.1\n"
	cites := ExtractFile("x/retry_test.go", code)
	if len(cites) != 5 {
		t.Fatalf("cites = %v, want 5", cites)
	}
	defined, err := ParseAnchors(sampleMD)
	if err != nil {
		t.Fatal(err)
	}
	if u := Undefined(cites, defined); len(u) != 0 {
		t.Fatalf("undefined with every anchor present: %v", u)
	}

	removed := strings.Replace(sampleMD, `<a id="r4-9"></a>`, "", 1)
	defined, err = ParseAnchors(removed)
	if err == nil || !strings.Contains(err.Error(), `line 6: R4.9 has no anchor "r4-9"`) {
		t.Errorf("ParseAnchors without r4-9: err = %v, want the entry reported", err)
	}
	got := Undefined(cites, defined)
	want := []Citation{{"x/retry_test.go", 1, "R4.9"}, {"x/retry_test.go", 2, "R4.9"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("undefined after removing r4-9 = %v, want %v", got, want)
	}
	if got[0].String() != "x/retry_test.go:1: R4.9" {
		t.Errorf("String = %q", got[0].String())
	}
}

// repoRoot is the directory holding go.mod above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}

func skipSelf(rel string) bool { return rel == self }

func readRequirements(t *testing.T, root string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docs", "requirements.md"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestCodeCitesOnlyDefinedRequirements is the check itself: every
// requirement number cited by Go code in the repository has an anchor in
// docs/requirements.md.
func TestCodeCitesOnlyDefinedRequirements(t *testing.T) {
	root := repoRoot(t)
	md := readRequirements(t, root)
	defined, err := ParseAnchors(md)
	if err != nil {
		t.Fatalf("docs/requirements.md: %v", err)
	}
	cites, err := Scan(root, scanned, skipSelf)
	if err != nil {
		t.Fatal(err)
	}
	if len(cites) == 0 {
		t.Fatal("found no citations at all; the scan is broken")
	}
	if u := Undefined(cites, defined); len(u) > 0 {
		var b strings.Builder
		for _, c := range u {
			b.WriteString("\n\t" + c.String())
		}
		t.Errorf("%d citations of requirements that docs/requirements.md does not define "+
			"(add an <a id=\"rN-M\"></a> line there, or fix the number):%s", len(u), b.String())
	}

	// The same check must notice a deleted anchor: take away the anchor of
	// the most cited requirement and expect its citations to be reported.
	count := map[Ref]int{}
	for _, c := range cites {
		count[c.Ref]++
	}
	var top Ref
	for ref, n := range count {
		if defined[ref] && (n > count[top] || n == count[top] && ref < top) {
			top = ref
		}
	}
	anchor := `<a id="` + top.Anchor() + `"></a>`
	if !strings.Contains(md, anchor) {
		t.Fatalf("no %s in docs/requirements.md", anchor)
	}
	without, err := ParseAnchors(strings.Replace(md, anchor, "", 1))
	if err == nil || !strings.Contains(err.Error(), string(top)+" has no anchor") {
		t.Errorf("without %s: ParseAnchors err = %v, want the entry reported", anchor, err)
	}
	n := 0
	for _, c := range Undefined(cites, without) {
		if c.Ref == top {
			n++
		}
	}
	if n != count[top] {
		t.Errorf("without %s: %d citations reported, want %d", anchor, n, count[top])
	}
}

var linkRE = regexp.MustCompile(`requirements\.md#([A-Za-z0-9_-]+)|\]\(#(r[0-9][a-z0-9-]*)\)`)

// TestLinksToRequirementsResolve checks links into docs/requirements.md
// (requirements.md#r4-9 from Go files, README.md and docs/**, and requirements.md's
// own (#r4-9) links) against its anchors.
func TestLinksToRequirementsResolve(t *testing.T) {
	root := repoRoot(t)
	md := readRequirements(t, root)
	anchors := map[string]bool{}
	for _, m := range anchorRE.FindAllStringSubmatch(md, -1) {
		anchors[m[1]] = true
	}

	files := []string{"README.md"}
	// Every doc, those in folders under docs/ (operations/, contributors/)
	// too.
	for _, pattern := range []string{"*.md", "*/*.md"} {
		docs, _ := filepath.Glob(filepath.Join(root, "docs", pattern))
		for _, d := range docs {
			rel, _ := filepath.Rel(root, d)
			files = append(files, filepath.ToSlash(rel))
		}
	}
	for _, dir := range scanned {
		filepath.WalkDir(filepath.Join(root, dir), func(path string, d os.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			rel, _ := filepath.Rel(root, path)
			rel = filepath.ToSlash(rel)
			if d.IsDir() && (d.Name() == "gen" || rel == self) {
				return filepath.SkipDir
			}
			if strings.HasSuffix(rel, ".go") {
				files = append(files, rel)
			}
			return nil
		})
	}
	links := 0
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		own := f == "docs/requirements.md"
		for n, line := range strings.Split(string(b), "\n") {
			for _, m := range linkRE.FindAllStringSubmatch(line, -1) {
				frag := m[1]
				if frag == "" {
					if !own {
						continue // another page's own heading link
					}
					frag = m[2]
				}
				links++
				if !anchors[frag] {
					t.Errorf("%s:%d: link to requirements.md#%s, which has no such anchor", f, n+1, frag)
				}
			}
		}
	}
	if links == 0 {
		t.Error("found no links into docs/requirements.md; the link scan is broken")
	}
}
