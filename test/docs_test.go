package test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// The README is the front door; the rest of the documentation lives in
// docs/, one page per subject. These tests read both as files, relative to
// the module root (the test runs in test/).

// docPages returns README.md and every page of docs/, as paths relative to
// the module root.
func docPages(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob(filepath.Join("..", "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) == 0 {
		t.Fatal("docs/ has no page")
	}
	files := []string{"README.md"}
	for _, p := range pages {
		rel, _ := filepath.Rel("..", p)
		files = append(files, filepath.ToSlash(rel))
	}
	return files
}

// readDoc returns the text of file, a path relative to the module root.
func readDoc(t *testing.T, file string) string {
	t.Helper()
	text, err := os.ReadFile(filepath.Join("..", filepath.FromSlash(file)))
	if err != nil {
		t.Fatal(err)
	}
	return string(text)
}

// heading is one Markdown heading outside code blocks.
type heading struct {
	level int
	text  string
	line  int // index into the document's lines
}

// headings returns the ATX headings of a Markdown text, skipping fenced code.
func headings(lines []string) []heading {
	var hs []heading
	fenced := false
	for i, line := range lines {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		level := len(line) - len(strings.TrimLeft(line, "#"))
		if level >= 1 && level <= 6 && strings.HasPrefix(line[level:], " ") {
			hs = append(hs, heading{level, strings.TrimSpace(line[level:]), i})
		}
	}
	return hs
}

// docSnippet returns the first code block in language lang ("go", "yaml")
// of the section of file headed heading (the whole heading line, as
// "## Use sluice in your own worker"), up to the next heading of the same
// level or above.
func docSnippet(t *testing.T, file, want, lang string) string {
	t.Helper()
	lines := strings.Split(readDoc(t, file), "\n")
	hs := headings(lines)
	i := slices.IndexFunc(hs, func(h heading) bool { return strings.Repeat("#", h.level)+" "+h.text == want })
	if i < 0 {
		t.Fatalf("%s has no section %q", file, want)
	}
	end := len(lines)
	for _, h := range hs[i+1:] {
		if h.level <= hs[i].level {
			end = h.line
			break
		}
	}
	section := strings.Join(lines[hs[i].line+1:end], "\n")
	_, code, ok := strings.Cut(section, "```"+lang+"\n")
	if !ok {
		t.Fatalf("%s section %q has no %s code block", file, want, lang)
	}
	code, _, _ = strings.Cut(code, "```")
	return code
}

// githubSlug is the anchor GitHub gives a heading: lower case, spaces to
// '-', every other character but letters, digits, '-' and '_' dropped.
func githubSlug(text string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors returns the anchors of a Markdown text's headings; a repeated
// slug gets -1, -2, ... as GitHub numbers them.
func anchors(text string) map[string]bool {
	seen := map[string]int{}
	out := map[string]bool{}
	for _, h := range headings(strings.Split(text, "\n")) {
		slug := githubSlug(h.text)
		if n := seen[slug]; n > 0 {
			out[slug+"-"+strconv.Itoa(n)] = true
		} else {
			out[slug] = true
		}
		seen[slug]++
	}
	return out
}

var (
	fence    = regexp.MustCompile("(?ms)^```.*?^```")
	codeSpan = regexp.MustCompile("`[^`]*`")
	mdLink   = regexp.MustCompile(`\]\(([^)\s]+)\)`)
)

// links returns the targets of the inline links of a Markdown text,
// outside code blocks and code spans.
func links(text string) []string {
	text = fence.ReplaceAllString(text, "")
	text = codeSpan.ReplaceAllString(text, "code")
	var out []string
	for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
		out = append(out, m[1])
	}
	return out
}

// TestReadmeLinks: every relative link in README.md, docs/*.md and the
// examples' READMEs names a file or directory that exists and, with a
// #anchor, a heading of the page it names, by GitHub's rules for anchors;
// so moving a section between pages cannot leave a link behind.
func TestReadmeLinks(t *testing.T) {
	t.Parallel()
	examples, err := filepath.Glob(filepath.Join("..", "examples", "*", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := docPages(t)
	for _, e := range examples {
		rel, _ := filepath.Rel("..", e)
		files = append(files, filepath.ToSlash(rel))
	}
	for _, file := range files {
		text := readDoc(t, file)
		for _, target := range links(text) {
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.ToSlash(filepath.Join(filepath.Dir(file), path))
				if _, err := os.Stat(filepath.Join("..", dest)); err != nil {
					t.Errorf("%s: link %q: %s does not exist", file, target, dest)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(dest, ".md") {
				t.Errorf("%s: link %q: an anchor into %s, which is not a Markdown page", file, target, dest)
				continue
			}
			if !anchors(readDoc(t, dest))[anchor] {
				t.Errorf("%s: link %q: %s has no heading whose anchor is #%s", file, target, dest, anchor)
			}
		}
	}
}

// TestReadmeMapListsEveryPage: the README's map links to every page of
// docs/, so none can be reached only by chance.
func TestReadmeMapListsEveryPage(t *testing.T) {
	t.Parallel()
	const mapHeading = "## Map"
	lines := strings.Split(readDoc(t, "README.md"), "\n")
	hs := headings(lines)
	i := slices.IndexFunc(hs, func(h heading) bool { return "## "+h.text == mapHeading })
	if i < 0 {
		t.Fatalf("README.md has no section %q", mapHeading)
	}
	end := len(lines)
	for _, h := range hs[i+1:] {
		if h.level <= 2 {
			end = h.line
			break
		}
	}
	linked := map[string]bool{}
	for _, target := range links(strings.Join(lines[hs[i].line:end], "\n")) {
		path, _, _ := strings.Cut(target, "#")
		linked[filepath.ToSlash(filepath.Clean(path))] = true
	}
	for _, page := range docPages(t)[1:] {
		if !linked[page] {
			t.Errorf("README.md's %q does not link to %s", mapHeading, page)
		}
	}
}

// TestReadmeAnchorSlugs pins the anchor rules the link test relies on, with
// headings of these very docs.
func TestReadmeAnchorSlugs(t *testing.T) {
	for _, tt := range []struct{ desc, heading, want string }{
		{"words", "Use sluice in your own worker", "use-sluice-in-your-own-worker"},
		{"comma", "Per-customer API quotas, start to finish", "per-customer-api-quotas-start-to-finish"},
		{"code and flags", "`enqueue status [--watch] [--json]`", "enqueue-status---watch---json"},
		{"colon", "throttle: five algorithms, two engines", "throttle-five-algorithms-two-engines"},
		{"underscore kept", "Metrics (prefix `sluice_`)", "metrics-prefix-sluice_"},
	} {
		if got := githubSlug(tt.heading); got != tt.want {
			t.Errorf("%s: githubSlug(%q) = %q, want %q", tt.desc, tt.heading, got, tt.want)
		}
	}
}
