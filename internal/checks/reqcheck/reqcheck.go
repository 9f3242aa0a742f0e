package reqcheck

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// Ref is one requirement number in its written form: "R4", "R4.9" or
// "R4.9a". An identifier's R4_9 is the Ref "R4.9".
type Ref string

// Anchor is the id of the Ref's anchor in docs/requirements.md: "r4-9".
func (r Ref) Anchor() string {
	return strings.ToLower(strings.ReplaceAll(string(r), ".", "-"))
}

// Section is the Ref's section: "R4" for "R4.9".
func (r Ref) Section() Ref {
	if i := strings.IndexByte(string(r), '.'); i >= 0 {
		return r[:i]
	}
	return r
}

// base64Run is how long a run of base64 characters around a match must be
// for the match to be taken as part of encoded data rather than a citation.
const base64Run = 16

func isDigit(c byte) bool { return '0' <= c && c <= '9' }
func isLower(c byte) bool { return 'a' <= c && c <= 'z' }
func isWord(c byte) bool {
	return isDigit(c) || isLower(c) || ('A' <= c && c <= 'Z') || c == '_'
}
func isBase64(c byte) bool {
	return isDigit(c) || isLower(c) || ('A' <= c && c <= 'Z') || c == '+' || c == '/' || c == '='
}

// digits returns the end of the run of digits that starts at i.
func digits(s string, i int) int {
	for i < len(s) && isDigit(s[i]) {
		i++
	}
	return i
}

// inBase64 reports whether the section-only match s[start:end] sits in a
// run of at least base64Run base64 characters that holds a '+', '/' or '='
// (a dotted match never does: base64 has no '.').
func inBase64(s string, start, end int) bool {
	if strings.Contains(s[start:end], ".") {
		return false
	}
	lo, hi := start, end
	for lo > 0 && isBase64(s[lo-1]) {
		lo--
	}
	for hi < len(s) && isBase64(s[hi]) {
		hi++
	}
	return hi-lo >= base64Run && strings.ContainsAny(s[lo:hi], "+/=")
}

// Extract returns the requirement numbers that line cites, in order.
func Extract(line string) []Ref {
	var refs []Ref
	for i := 0; i < len(line); i++ {
		if line[i] != 'R' || i+1 >= len(line) || !isDigit(line[i+1]) {
			continue
		}
		prevWord := i > 0 && isWord(line[i-1])
		prevDigit := i > 0 && isDigit(line[i-1])
		secEnd := digits(line, i+1)
		sec := line[i+1 : secEnd]

		// Identifier form: R4_9, after anything but a digit.
		if !prevDigit && secEnd+1 < len(line) && line[secEnd] == '_' && isDigit(line[secEnd+1]) {
			subEnd := digits(line, secEnd+1)
			refs = append(refs, Ref("R"+sec+"."+line[secEnd+1:subEnd]))
			i = subEnd - 1
			continue
		}
		if prevWord {
			continue
		}

		// Word form: R4, R4.9, R4.9a.
		end := secEnd
		ref := "R" + sec
		if end+1 < len(line) && line[end] == '.' && isDigit(line[end+1]) {
			subEnd := digits(line, end+1)
			ref += "." + line[end+1:subEnd]
			end = subEnd
			if end < len(line) && isLower(line[end]) && (end+1 == len(line) || !isWord(line[end+1])) {
				ref += line[end : end+1]
				end++
			}
		}
		if end < len(line) && isWord(line[end]) {
			continue // R2D2, R4s
		}
		if end+1 < len(line) && line[end] == '.' && isDigit(line[end+1]) {
			continue // R1.2.3: a version, not a requirement
		}
		if inBase64(line, i, end) {
			continue
		}
		refs = append(refs, Ref(ref))
		i = end - 1
	}
	return refs
}

var anchorRE = regexp.MustCompile(`<a id="([^"]*)"></a>`)
var anchorIDRE = regexp.MustCompile(`^r([0-9]+)(?:-([0-9]+[a-z]?))?$`)

// labelRE finds the start of a requirement's entry: a section heading
// "## R4 …" or a list item "- **R4.9** …", with or without its anchor.
var labelRE = regexp.MustCompile(`(?m)^(?:- |## )(<a id="[^"]*"></a>)?\**(R[0-9]+(?:\.[0-9]+[a-z]?)?)\b`)

// ParseAnchors returns the requirement numbers that a requirements.md
// defines, one per explicit anchor <a id="r4-9"></a>. It fails on an anchor
// that is not of that form, on a duplicate, on a requirement whose section
// has no anchor, and on an anchor not followed by its own number (the
// anchor "r4-9" must be followed by R4.9, optionally in bold), so that a
// renumbered line cannot keep a stale anchor, and on an entry ("## R4 …",
// "- **R4.9** …") that has lost its anchor.
func ParseAnchors(md string) (map[Ref]bool, error) {
	defined := map[Ref]bool{}
	var problems []string
	for _, m := range anchorRE.FindAllStringSubmatchIndex(md, -1) {
		id := md[m[2]:m[3]]
		line := 1 + strings.Count(md[:m[0]], "\n")
		p := anchorIDRE.FindStringSubmatch(id)
		if p == nil {
			problems = append(problems, fmt.Sprintf("line %d: anchor %q is not r<n> or r<n>-<m>", line, id))
			continue
		}
		ref := Ref("R" + p[1])
		if p[2] != "" {
			ref += Ref("." + p[2])
		}
		if defined[ref] {
			problems = append(problems, fmt.Sprintf("line %d: second anchor for %s", line, ref))
		}
		defined[ref] = true
		after := strings.TrimLeft(md[m[1]:], "*")
		if !strings.HasPrefix(after, string(ref)) || (len(after) > len(ref) && isWord(after[len(ref)])) {
			problems = append(problems, fmt.Sprintf("line %d: anchor %q is not followed by %s", line, id, ref))
		}
	}
	for _, m := range labelRE.FindAllStringSubmatchIndex(md, -1) {
		if m[2] < 0 {
			line := 1 + strings.Count(md[:m[0]], "\n")
			problems = append(problems, fmt.Sprintf("line %d: %s has no anchor %q", line, md[m[4]:m[5]], Ref(md[m[4]:m[5]]).Anchor()))
		}
	}
	for ref := range defined {
		if !defined[ref.Section()] {
			problems = append(problems, fmt.Sprintf("%s has no section anchor %q", ref, ref.Section().Anchor()))
		}
	}
	if len(problems) > 0 {
		sort.Strings(problems)
		return defined, fmt.Errorf("requirements anchors: %s", strings.Join(problems, "; "))
	}
	return defined, nil
}

// Citation is one requirement number cited at a file's line.
type Citation struct {
	File string // slash-separated, relative to the scanned root
	Line int
	Ref  Ref
}

func (c Citation) String() string { return fmt.Sprintf("%s:%d: %s", c.File, c.Line, c.Ref) }

// ExtractFile returns the citations in one file's text.
func ExtractFile(name, text string) []Citation {
	var out []Citation
	for n, line := range strings.Split(text, "\n") {
		for _, ref := range Extract(line) {
			out = append(out, Citation{File: name, Line: n + 1, Ref: ref})
		}
	}
	return out
}

// Scan returns the citations in every .go file under root's dirs (a missing
// dir is skipped), leaving out directories named gen and any file or
// directory for which skip, given its slash-separated path relative to
// root, reports true. skip may be nil.
func Scan(root string, dirs []string, skip func(rel string) bool) ([]Citation, error) {
	var out []Citation
	for _, dir := range dirs {
		top := filepath.Join(root, dir)
		if _, err := os.Stat(top); os.IsNotExist(err) {
			continue
		}
		err := filepath.WalkDir(top, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			rel = filepath.ToSlash(rel)
			if d.IsDir() {
				if d.Name() == "gen" || (skip != nil && skip(rel)) {
					return filepath.SkipDir
				}
				return nil
			}
			if !strings.HasSuffix(rel, ".go") || (skip != nil && skip(rel)) {
				return nil
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			out = append(out, ExtractFile(rel, string(b))...)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Undefined returns the citations whose number defined lacks.
func Undefined(cites []Citation, defined map[Ref]bool) []Citation {
	var out []Citation
	for _, c := range cites {
		if !defined[c.Ref] {
			out = append(out, c)
		}
	}
	return out
}
